"""Our child processes: free ports and waiting for them to answer (`ports`), handing them secrets through a pipe
(`secret_handover`), stopping them and what they started (`children`), and starting them by fork from a preloaded
interpreter when one is running (`forkserver`, `preload_server`).

Generic: the engines (`engines/processes.py`), the gateways (`gateway/processes.py`), the harnesses and vLLM are
started with these. Nothing here knows which program it starts.
"""
