"""The embedded CPU engine: an SGLang-compatible HTTP server over a transformers model.

SGLang is the production engine (GPU). This package speaks the subset of SGLang's HTTP contract the gateway uses,
so the gateway's code path is identical in tests, in the demo and in production.
"""
