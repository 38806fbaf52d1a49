"""The `serve` command's non-terminal half: the decode worker (worker.py), the OpenAI-compatible HTTP app
(app.py) and the request checks and response bodies it speaks (protocol.py)."""
