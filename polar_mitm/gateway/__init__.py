"""The capture gateway: everything between a harness's HTTP request and a durable record.

Only `addons/` (the mitmproxy addons `addon/polar.py` composes, one concern each) hooks into mitmproxy; the rest is
plain Python so it can be tested and reused without it.
"""
