"""Engine dialects: what differs between the engine kinds the gateway talks to (SGLang, vLLM, the embedded engine).

SGLang's API is the gateway's own; `vllm.py` translates vLLM's calls, answers and streams to and from it.
"""
