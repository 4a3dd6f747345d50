"""Command line: ``refine`` (one clip), ``make-checkpoint`` (random test refiner), ``serve`` (the service), ``plan``
(a capacity plan, no weights: ``app.cli.plan_command``),
``stream``, ``sessions`` and ``watch`` (a running server, through ``wm_refiner_client``: ``app.cli.remote``,
``app.cli.watch``). Errors go to
stderr with a non-zero exit status; progress bars go to stderr only when it is a terminal. The benchmarks are not a
service command: they are ``python -m bench``, from a checkout (the service must not depend on its benchmarks).

Exit statuses: 0 done; 2 refused (a bad flag, input or server answer, a port in use: one ``error: ...`` line on
stderr saying what to give instead); 130 interrupted by Ctrl-C (``stream`` first writes what it received and says
how to continue); ``serve`` 3 when its start-up failed for another reason than what it was given (uvicorn's, traceback in the log)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    from wm_refiner_client import __version__

    parser = argparse.ArgumentParser(prog="python -m app", description="wm-refiner: streaming SANA-WM refiner")
    parser.add_argument("--version", action="version", version=f"wm-refiner {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    refine = commands.add_parser("refine", help="refine one clip from a safetensors file")
    refine.add_argument("--model", help="refiner folder (diffusers layout); default: the embedded tiny refiner that "
                                        "`serve` uses, built on first use")
    refine.add_argument("--input", required=True, help="safetensors with latents, prompt_embeds[, prompt_attention_mask]")
    refine.add_argument("--output", required=True, help="safetensors to write the refined latents to (float32)")
    from app.cli.remote import add_session_flags, add_sessions_parser, add_stream_parser
    from wm_refiner_client import spec

    add_session_flags(refine, spec.CONFIG_NAMES, defaults=True)  # the model's config; no VAE here
    refine.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    refine.add_argument("--dtype", default="float32", help="float32, bfloat16, float16, float64 or auto")

    make = commands.add_parser("make-checkpoint", help="write a random refiner folder for tests and benchmarks")
    make.add_argument("--preset", choices=("tiny", "medium", "tiny-vae", "released-depth-vae"), default="tiny",
                      help="a refiner (tiny, medium) or an LTX-2 video VAE (tiny-vae, released-depth-vae)")
    make.add_argument("--out", required=True, help="folder to write (config.json and the safetensors weights)")
    make.add_argument("--seed", type=int, default=0, help="the random weights' seed (default 0)")

    serve = commands.add_parser("serve", help="run the HTTP/WebSocket service")
    serve.add_argument("--config", help="YAML settings file (see configs/)")
    serve.add_argument("--model", help="refiner folder; default: the embedded tiny refiner, built on first start")
    serve.add_argument("--vae", help="LTX-2 video VAE folder (AutoencoderKLLTX2Video) for video outputs")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface: set "
                                      "--api-key then)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8000)")
    serve.add_argument("--device", help="cpu, cuda, cuda:N or auto (default: CUDA if available)")
    serve.add_argument("--dtype", help="float32, bfloat16, float16, float64 or auto (default: bf16 on CUDA, else fp32)")
    serve.add_argument("--api-key", help="bearer key every route but /health, /ready, /metrics, /view and its script "
                       "needs (default: none)")
    serve.epilog = ("Every setting, with its WM_REFINER_* variable and YAML key: docs/operations.md. Flags override "
                    "the environment, which overrides the --config file.")

    add_stream_parser(commands)
    add_sessions_parser(commands)
    from app.cli.watch import add_watch_parser

    add_watch_parser(commands)
    from app.cli.plan_command import add_plan_parser

    add_plan_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # the alias this command had once: say where the benchmarks went
        print("error: `python -m app bench` is gone; run the benchmarks with `python -m bench` from a checkout "
              "(see docs/benchmarks.md)", file=sys.stderr)
        return 2
    parser = build_parser()
    if not argv:  # no command: what there is to run, rather than argparse's 'arguments are required: command'
        parser.print_help(sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        refuse_unknown(parser, args.command, unknown)
    return _report_errors(lambda: _dispatch(args))


def refuse_unknown(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> None:
    """Exit 2 with the usage of the subcommand that got ``unknown`` arguments, and the flag meant when one is close
    (argparse's own answer is the top-level usage, which lists no flag of the subcommand)."""
    import difflib

    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = subcommands.choices[command]
    flags = [option for action in sub._actions for option in action.option_strings]
    hints = []
    for argument in unknown:
        if argument.startswith("-"):
            close = difflib.get_close_matches(argument.split("=", 1)[0], flags, n=1)
            if close:
                hints.append(f"{argument.split('=', 1)[0]}: did you mean {close[0]}?")
    sub.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else "")
              + f"; see python -m app {command} --help")


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "refine":
        return refine_command(args)
    if args.command == "make-checkpoint":
        from models.checkpoints import VAE_PRESETS, write_checkpoint, write_vae_checkpoint

        if args.preset in VAE_PRESETS:
            out = write_vae_checkpoint(args.out, preset=args.preset, seed=args.seed)
            print(f"wrote a random {args.preset} (AutoencoderKLLTX2Video) to {out}")
            return 0
        out = write_checkpoint(args.out, preset=args.preset, seed=args.seed)
        print(f"wrote a random {args.preset} refiner to {out}")
        return 0
    if args.command == "serve":
        from app.cli.serve import serve_command

        return serve_command(args)
    if args.command == "plan":
        from app.cli.plan_command import plan_command

        return plan_command(args)
    if args.command == "watch":
        from app.cli import remote
        from app.cli.watch import watch_command

        remote.show_retries()
        return watch_command(args)
    if args.command in ("stream", "sessions"):
        from app.cli import remote

        remote.show_retries()
        return remote.stream_command(args) if args.command == "stream" else remote.sessions_command(args)
    return 1


def _report_errors(run) -> int:
    try:
        return run()
    except KeyboardInterrupt:  # Ctrl-C where no command handles it: one line, the shell's status for it
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the CLI's contract: one clear line on stderr, non-zero exit
        from wm_refiner_client import WmRefinerError

        refiner_errors = sys.modules.get("models.errors")  # not loaded: the error cannot be one of them
        serve = sys.modules.get("app.cli.serve")
        settings = sys.modules.get("app.core.settings")
        known = isinstance(exc, WmRefinerError) or (
            refiner_errors is not None and isinstance(exc, refiner_errors.RefinerError)
        ) or (serve is not None and isinstance(exc, serve.StartUpError)) or (
            settings is not None and isinstance(exc, settings.SettingsInputError))
        kind = "error" if known else f"error ({type(exc).__name__})"
        from wm_refiner_client import UnauthorizedError

        unauthorized = isinstance(exc, UnauthorizedError)
        hint = " (the CLI sends it from --api-key KEY or $WM_REFINER_API_KEY)" if unauthorized else ""
        print(f"{kind}: {exc}{hint}", file=sys.stderr)
        return 2


def refine_command(args: argparse.Namespace) -> int:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    from app.cli.remote import check_clip, session_flags
    from models import SessionConfig, load_refiner
    from wm_refiner_client import spec

    input_path = Path(args.input)
    if not input_path.is_file():
        raise FileNotFoundError(f"input file {str(input_path)!r} does not exist")
    try:
        tensors = load_file(str(input_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{input_path} is not a safetensors file ({exc}); write it with safetensors.torch.save_file")
    check_clip(input_path, tensors)
    config = SessionConfig.from_dict(session_flags(args, spec.CONFIG_NAMES))
    model = args.model
    if not model:  # as `serve` without --model: the embedded tiny refiner under cache_dir
        from app.core.settings import load_settings
        from app.runtime.services import ensure_embedded_model

        model = ensure_embedded_model(load_settings().embedded_model_dir)
    refiner = load_refiner(model, device=args.device, dtype=args.dtype)
    refined = refine_with_progress(
        refiner, tensors["latents"], tensors["prompt_embeds"], tensors.get("prompt_attention_mask"), config
    )
    output_path = Path(args.output)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"latents": refined.to(device="cpu", dtype=torch.float32).contiguous()}, str(output_path))
    by = "" if args.model else f" (the embedded tiny refiner at {model}; --model DIR for another)"
    print(f"refined {refined.shape[2]} frames -> {output_path}{by}")
    return 0


def refine_with_progress(refiner, latents, prompt_embeds, prompt_attention_mask, config):
    """``refine_clip``, block by block under a progress bar on stderr (a terminal only): the same bytes, as a
    session's output does not depend on how its frames are split into calls."""
    import torch
    from tqdm import tqdm

    from models import RefinerSession
    from models.clip import check_clip_length

    check_clip_length(latents, config)
    session = RefinerSession(refiner, config)
    parts = []
    with tqdm(total=int(latents.shape[2]), unit="frame", desc="refined", file=sys.stderr, disable=None) as bar:
        for unit in session.stream(latents, prompt_embeds, prompt_attention_mask, flush=True):
            parts.append(unit.latents)
            bar.update(unit.frame_end - unit.frame_start)
    return torch.cat(parts, dim=2)  # (B, C, T, H, W)
