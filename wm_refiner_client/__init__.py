"""wm_refiner_client: the Python client of the wm-refiner service (docs/client.md).

    from wm_refiner_client import Client

    client = Client("http://127.0.0.1:8000")                 # api_key=... or WM_REFINER_API_KEY
    session = client.create_session(seed=42)
    unit = session.send(latents, prompt=prompt)              # HTTP chunk; seq and retries are automatic
    for unit in session.stream(chunks, prompt=prompt):       # WebSocket; reconnects and resumes by itself
        ...
    clip = client.refine(latents, prompt).latents            # one shot

Arrays: numpy arrays or torch tensors in; numpy arrays out (``return_tensors="pt"`` for torch tensors). torch is
not required. ``AsyncClient`` offers the same with asyncio. Errors are typed (``wm_refiner_client.errors``).
"""

from ._common import BlockEvent, DroppedEvent, SessionState, SessionSummary, StreamStats
from .aio import AsyncClient, AsyncSession, AsyncStream, AsyncWatch
from .client import Client, Session, Stream, Watch
from .errors import *  # noqa: F403 (the error classes are part of the API)
from .errors import APIError, ProtocolError, TransportError, WmRefinerError
from .resume import Chunk
from .retry import RetryPolicy
from .units import EncodedVideo, Unit, concat

__version__ = "0.1.0"

__all__ = [
    "EncodedVideo",
    "AsyncClient",
    "AsyncSession",
    "AsyncStream",
    "AsyncWatch",
    "APIError",
    "BlockEvent",
    "Chunk",
    "Client",
    "DroppedEvent",
    "ProtocolError",
    "RetryPolicy",
    "Session",
    "SessionState",
    "SessionSummary",
    "Stream",
    "StreamStats",
    "Watch",
    "TransportError",
    "Unit",
    "WmRefinerError",
    "concat",
]
