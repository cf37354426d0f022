"""``bitune serve``: an OpenAI-compatible HTTP server with continuous batching for Bitune models.

Three rooms: :mod:`.protocol` (the HTTP shapes: request bodies, their checks and the scheduler job each
becomes, the error object, responses),
:mod:`.scheduler` (the one thread that owns the model: a bounded queue, prefill of new requests, decoding steps
of the running batch, through the library's own ``prefill`` and ``decode_step``) and :mod:`.app` (FastAPI
routes, the API key and body-size gate, streaming). FastAPI and uvicorn come with the ``serve`` extra.
"""
