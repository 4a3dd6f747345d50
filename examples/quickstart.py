"""The README's tour as a script: a clip through a running wm-refiner server three ways (HTTP chunks, a WebSocket
stream, one shot), the three results compared bit for bit, then the sessions listed and deleted.

    python -m app serve &                       # or any server; WM_REFINER_API_KEY if it has a key
    python examples/quickstart.py --server http://127.0.0.1:8000

Needs only the client (pip install ./clients/python): numpy arrays in, numpy arrays out. CI runs it against a live
server (tests/client/test_readme.py). Exits non-zero if the three results differ.
"""

from __future__ import annotations

import argparse

import numpy as np

from wm_refiner_client import Client, concat


def main(argv: list[str] | None = None) -> int:
    # The whole docstring, as written (its first line alone stopped mid-sentence).
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default=None, help="default: $WM_REFINER_URL, else http://127.0.0.1:8000")
    args = parser.parse_args(argv)

    with Client(args.server) as client:  # api_key=... or $WM_REFINER_API_KEY
        info = client.info()
        channels, caption_channels = info["model"]["channels"], info["model"]["caption_channels"]
        print(f"model {info['model']['class']}: {channels} latent channels, prompts {caption_channels} wide")

        rng = np.random.default_rng(0)
        latents = rng.standard_normal((1, channels, 11, 4, 4), dtype=np.float32)  # (B, C, T, H, W)
        prompt = rng.standard_normal((1, 8, caption_channels), dtype=np.float32)  # (B, L, D)

        # 1. HTTP chunks: each send is one request with the next seq; a lost answer is retried with the same seq.
        session = client.create_session(seed=42, block_size=3)
        units = [session.send(latents[:, :, :4], prompt=prompt), session.send(latents[:, :, 4:]), session.flush()]
        print("http:", [(u.frame_start, u.frame_end) for u in units])  # sink + block, two blocks, the short last one
        over_http = concat(units)

        # 2. A WebSocket stream: units arrive as blocks are refined; drops and restarts are resumed by the client.
        http_session, session = session, client.create_session(seed=42, block_size=3)
        chunks = (latents[:, :, start : start + 2] for start in range(0, 11, 2))
        units = list(session.stream(chunks, prompt=prompt))
        print("stream:", [(u.frame_start, u.frame_end) for u in units])
        streamed = concat(units)

        # 3. One shot.
        whole = client.refine(latents, prompt, seed=42, block_size=3).latents

        for summary in client.sessions():
            print("session", summary.session_id, summary.frames_returned, "frames, flushed:", summary.flushed)
        http_session.delete()
        session.delete()

    same = np.array_equal(over_http, whole) and np.array_equal(streamed, whole)
    print("refined", whole.shape, "identical on all three paths:", same)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
