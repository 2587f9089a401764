"""Trust on the link: the pair's secret and the authenticated channel built on it.

Every linkctl-to-linkctl exchange over the link (the responder's facts and calibration,
the kv-agent's KV and model copies) opens with a mutual HMAC-SHA256 challenge-response
over the pair secret (``session``); the secret itself, where it is kept and who may
read it, is ``secret``.
"""
