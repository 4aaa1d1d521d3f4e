"""fluidserve's HTTP frontend: an OpenAI-compatible server over ``AsyncEngine``.

* ``protocol.py`` — the OpenAI wire types (pydantic) and the error object
* ``errors.py``   — every failure as ``{"error": {...}}`` with the right status
* ``inputs.py``   — requests → prompt token ids + ``SamplingParams`` (tokenize, chat template, limits)
* ``render.py``   — engine outputs → responses and SSE chunks (logprobs, usage)
* ``api.py``      — the FastAPI app: routes, auth, admission, streaming, abort on disconnect
* ``metrics.py``  — Prometheus metrics (latency histograms, engine stats)
* ``server.py``   — uvicorn with a graceful SIGTERM drain
* ``cli.py``      — the ``fluidserve`` command (``serve``, ``bench``, ``profile``)
* ``bench_client.py`` — the open-loop load generator behind ``fluidserve bench``
"""
