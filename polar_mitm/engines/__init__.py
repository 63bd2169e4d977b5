"""The engines we talk to: which kind an engine is, how to call it, how to push weights to it.

- `client.py`: the gateway's async HTTP client (chat with ids and logprobs, streams, aborts), in SGLang's shape
  whatever the engine; `stream.py` assembles a streamed answer; `description.py` writes `_engine.json` beside the
  records (its format is `storage/engine_info.py`'s);
- `dialects/`: what differs between engine kinds, one class per kind (SGLang, vLLM, the embedded engine) and the
  registry that declares the kinds and recognises an engine's: nothing outside it branches on a kind;
- `weights.py`: the weight version each engine serves, and weight pushes; `router.py`: several engines behind
  SGLang's router;
- `processes.py`: the embedded engine (`polar-mitm serve`) as a child process; `keys.py`: every engine's API key
  (the client's header and the servers' `KeyGuard`); `greedy.py`: what counts as greedy sampling.

The engines themselves live elsewhere: the embedded CPU engine in `polar_mitm/engine/`, vLLM's launcher and worker
extension in `polar_mitm/vllm/`. Imports nothing at package level: `keys.py` is loaded inside vLLM's own venv.
"""
