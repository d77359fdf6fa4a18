"""The user's data, below every model: the bundled corpus, user data (text, tables, `datasets`), tokenizers,
datasets and loaders. It imports only core."""
