"""A step's host arrays as the compiled step takes them: its 1-D arrays packed into one int32 and one float32
buffer, its 2-D ones (page tables, bias rows, token bitmasks; some kept on the device) passed as they are.

A jit call costs per argument: on CPU each numpy array it uploads costs ~6 us, on a GPU each is a host-to-device
copy of its own. A step has about 30 small 1-D arrays, so they travel as two.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

PACKED_DTYPES = {np.dtype(np.int32): "int", np.dtype(np.uint32): "int", np.dtype(bool): "int",
                 np.dtype(np.float32): "float"}  # fmt: skip


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedStep:
    ints: jax.Array  # [I] i32: the int32, uint32 (bit for bit) and bool 1-D arrays, one after the other
    floats: jax.Array  # [F] f32: the float32 1-D arrays
    arrays: tuple  # the other arrays, in leaf order


@dataclass(frozen=True)
class StepPacking:
    """Where each leaf of one bucket's StepInput goes (static: the compiled step is specialised to it)."""

    treedef: jax.tree_util.PyTreeDef
    # per leaf: ("int" | "float", offset, length, dtype name) for packed ones, ("array", index, 0, "") otherwise
    places: tuple[tuple[str, int, int, str], ...]
    kinds: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # the leaves of each buffer, and the others

    @staticmethod
    def of(step) -> StepPacking:
        """The packing of steps shaped like `step` (a StepInput of numpy or device arrays)."""
        leaves, treedef = jax.tree_util.tree_flatten(step)
        places, sizes, arrays = [], {"int": 0, "float": 0}, 0
        for leaf in leaves:
            kind = PACKED_DTYPES.get(np.dtype(leaf.dtype)) if leaf.ndim == 1 else None
            if kind is None:
                places.append(("array", arrays, 0, ""))
                arrays += 1
                continue
            places.append((kind, sizes[kind], leaf.shape[0], np.dtype(leaf.dtype).name))
            sizes[kind] += leaf.shape[0]
        kinds = tuple(tuple(i for i, (k, *_) in enumerate(places) if k == kind) for kind in ("int", "float", "array"))
        return StepPacking(treedef, tuple(places), kinds)

    def pack(self, step) -> PackedStep:
        """On the host: the step's numpy arrays into the two buffers (in leaf order, as `places` has them; one
        concatenation each, uint32 and bool cast to int32 bit for bit)."""
        leaves = self.treedef.flatten_up_to(step)
        int_leaves, float_leaves, array_leaves = self.kinds
        ints = np.concatenate([leaves[i] for i in int_leaves], dtype=np.int32, casting="unsafe")
        floats = np.concatenate([leaves[i] for i in float_leaves], dtype=np.float32)
        return PackedStep(ints, floats, tuple(leaves[i] for i in array_leaves))

    def unpack(self, packed: PackedStep):
        """In the step: the StepInput again."""
        leaves = []
        for kind, offset, length, dtype in self.places:
            if kind == "array":
                leaves.append(packed.arrays[offset])
            elif kind == "float":
                leaves.append(packed.floats[offset : offset + length])
            else:
                column = packed.ints[offset : offset + length]
                if dtype == "bool":
                    column = column != 0
                elif dtype == "uint32":
                    column = jax.lax.bitcast_convert_type(column, jnp.uint32)
                leaves.append(column)
        return self.treedef.unflatten(leaves)
