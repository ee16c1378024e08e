"""Texts and conversations the tokenizer tests compare on."""

# Plain text (no special tokens): whitespace runs, newlines, accents, CJK, emoji, the empty string.
PLAIN_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Punctuation: (a), [b]; {c}! \"quoted\" & 'single' -- dash... ok?",
    "x  y    z",
    "line one\nline two\n\n\nafter blank lines\r\nwindows",
    "\ttabbed\t\ttext",
    "Café naïve résumé façade",
    "日本語のテキスト 中文 한국어",
    "emoji 🙂🚀 and flags 🇫🇷 and a family 👨‍👩‍👧",
    "trailing space ",
    "",
]

CONVERSATIONS = {
    "single user turn": [{"role": "user", "content": "What is the capital of France?"}],
    "with system prompt": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "multi turn": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan? 日本"},
    ],
}
