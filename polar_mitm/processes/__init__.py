"""Our child processes: free ports and waiting for them to answer (`ports`), handing them secrets through a pipe
(`secret_handover`), and stopping them and what they started (`children`).

Generic: the engines (`engines/processes.py`), the gateways (`gateway/processes.py`), the harnesses and vLLM are
started with these. Nothing here knows which program it starts.
"""
