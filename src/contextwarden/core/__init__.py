"""The core: trimming a chat to a budget, pure (a chat and options in, a choice out).

Modules: carry, chatview, conversation, decision, excerpt, flags, fresh, recall, recall_index, relevance,
selection, semantic, shorten, tokens, trim, trim_types.
It imports only itself and the package's own modules (`errors`, `caches`, `backoff`, and
`encoding_files`, which loads tiktoken's encodings, with `netclient`): nothing of Open WebUI,
of storage or of pricing (earlier decisions for a chat are passed in as values).
See DESIGN.md, "Which part uses which".
"""
