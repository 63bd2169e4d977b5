"""The capture gateway: everything between a harness's HTTP request and a durable record.

Only `mitm_addon` imports mitmproxy; the rest is plain Python so it can be tested and reused without it.
"""
