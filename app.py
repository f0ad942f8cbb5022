#!/usr/bin/env python3
"""LoRA Studio: the one entry point.

    python app.py [serve] [MODEL] ...      the UI + HTTP API (default model: demo:qwen-image)
    python app.py generate --model M --prompt TEXT ...
    python app.py adapters [--model M]     the adapter library and how each fits M
    python app.py presets                  distill presets and which files are present
    python app.py ray-up                   a Ray head on this machine (for serve --engine ray)

Bad flags, files or values exit 2 with one line naming what is wrong.
"""
from __future__ import annotations

import argparse
import sys

from backend.families import DEFAULT_MODEL, task_types  # plain data: no torch imported here

COMMANDS = ("serve", "generate", "adapters", "presets", "ray-up", "export-lora", "bake", "hash-password")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem (exit 2)."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message}\n")


class DefaultsHelp(argparse.HelpFormatter):
    """Each flag's help ends with its default, when it has one the help does not already name."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, argparse.SUPPRESS, False, []) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _stack_command(sub, name: str, what: str, model_help: str, output: str, output_help: str):
    """A command that takes a stack of adapters (``NAME[:WEIGHT]`` ...), ``--model`` and ``--output``."""
    p = sub.add_parser(name, help=what)
    p.add_argument("adapters", nargs="+", metavar="NAME[:WEIGHT]",
                   help="library names or adapter files, each with an optional weight (default: its preferred "
                        "weight, else 1.0), in stack order")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"{model_help} (default: %(default)s)")
    p.add_argument("--output", "-o", required=True, metavar=output, help=output_help)
    return p


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", help="where models, adapters, outputs and the job queue live "
                                      "(default: $LORA_STUDIO_HOME or ~/.cache/lora-studio)")
    p.add_argument("--adapter-dir", action="append", default=[], metavar="DIR",
                   help="an adapter library root (repeatable); <data-dir>/adapters is always included")


def _scale_arg(text: str):
    """--lora-scale: a number, 1.0,0.8,0.5, 0.5->1.0 or JSON (backend/lora/schedule.py), checked here."""
    from backend.errors import InvalidParameter
    from backend.lora.schedule import parse_text

    try:
        return parse_text(text, "--lora-scale")
    except InvalidParameter as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _number_scale(args) -> None:
    """serve and the distill backend fuse or pre-load with one number: a schedule is per request."""
    if not isinstance(args.lora_scale, float):
        from backend.errors import InvalidParameter

        raise InvalidParameter("--lora-scale: a step schedule or block weights apply per request (generate "
                               "--lora-backend peft, or the HTTP lora object's scale); here give a number",
                               param="lora_scale")


def _lora(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-backend", choices=("peft", "distill"), default="peft",
                   help="peft: adapters per request; distill: fuse --lora-path into the base at start")
    p.add_argument("--lora-path", nargs="+", metavar="P", help="adapter file(s) or PEFT folder(s)")
    p.add_argument("--lora-scale", type=_scale_arg, default=1.0, metavar="S",
                   help="the weight of the --lora-path adapters: a number; generate (peft) also takes a step "
                        "schedule 1.0,0.8,0.5 or 0.5->1.0, or JSON with per-expert or per-block weights "
                        "(docs/lora.md, 'Scheduled and per-block scales')")
    p.add_argument("--lora-mode", choices=("auto", "merge", "unfused"), default=None,
                   help="peft: merge adapters into the weights, serve them unfused (hooks, no weight write), "
                        "or pick per request by cost (default: auto on CUDA, merge on CPU; docs/lora.md)")
    p.add_argument("--preset", metavar="ID", help="a distill preset from presets/ (see `app.py presets`)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--offload", choices=("none", "model", "group"), default="none",
                   help="MiniMax-H3: model = whole components CPU<->GPU, group = transformer blocks on demand "
                        "(docs/minimax.md)")
    p.add_argument("--offload-stream", action="store_true",
                   help="--offload group: prefetch the next block on a CUDA stream")
    p.add_argument("--quantize", choices=("none", "fp8"), default="none",
                   help="fp8: store the denoisers' weights in fp8 (diffusers' layerwise casting, computed in --dtype); "
                        "adapters then run unfused only (docs/lora.md, Quantized bases)")
    p.add_argument("--gguf", action="append", default=[], metavar="[COMPONENT=]PATH",
                   help="load the transformer (or COMPONENT, e.g. transformer_2) from a GGUF file, e.g. a city96 "
                        "Q8_0/Q4_0 file; adapters then run unfused only (repeatable)")
    p.add_argument("--pristine", choices=("auto", "device", "host"), default="auto",
                   help="peft: where the originals of merged layers live: device (no transfer per switch), "
                        "host (pinned RAM, copied on a side stream), auto (device when it fits; docs/lora.md)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="app.py", description="LoRA Studio: diffusion models with LoRA adapters.")
    sub = parser.add_subparsers(dest="command", metavar="{serve,generate,adapters,presets,ray-up}",
                                parser_class=OneLineParser)

    serve = sub.add_parser("serve", help="serve the UI and the HTTP API (default)")
    serve.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help=f"the model to serve (default: the Settings tab's default model, else {DEFAULT_MODEL})")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=7860)
    serve.add_argument("--share", action="store_true", help="a public Gradio link (requires --auth or --api-key)")
    serve.add_argument("--auth", metavar="USER:PASS",
                       help="require this login on every route (UI form, or HTTP Basic) but /health")
    serve.add_argument("--auth-file", metavar="FILE",
                       help="several users, one USER:HASH a line (bcrypt or scrypt; `app.py hash-password USER` "
                            "writes one): each sees only their own jobs and outputs (docs/security.md)")
    serve.add_argument("--api-key", metavar="[NAME=]KEY", action="append",
                       help="require 'Authorization: Bearer KEY' (or a login with KEY as password) on every "
                            "route but /health; repeat for several keys, NAME=KEY names the user a key acts as")
    serve.add_argument("--admin", metavar="NAME", action="append", default=[],
                       help="a user or key name that sees everyone's jobs and outputs (repeatable; the --auth "
                            "login and an unnamed key always do)")
    serve.add_argument("--max-loras", type=int, default=4, metavar="N", help="adapters resident on the device")
    serve.add_argument("--max-cpu-loras", type=int, default=16, metavar="N", help="adapters held in CPU memory")
    serve.add_argument("--max-queue", type=int, default=256, metavar="N", help="queued jobs before 429")
    serve.add_argument("--lora-prefetch", type=int, default=2, metavar="N",
                       help="while a job runs, read the adapters of the next N queued jobs into the cache (0: off)")
    serve.add_argument("--max-batch", type=int, default=1, metavar="N",
                       help="run up to N queued generate jobs that differ only in prompt, seed and adapters as one "
                            "batched call when the cost model predicts it is faster (1: one job at a time)")
    limits = serve.add_argument_group("request limits (a request over one is a 400 naming the field; "
                                      "docs/security.md)")
    limits.add_argument("--max-side", type=int, metavar="PX",
                        help="largest height or width (default: per model family, e.g. 2048 for images)")
    limits.add_argument("--max-frames", type=int, metavar="N", help="most video frames (default: per model family)")
    limits.add_argument("--max-work", type=int, metavar="N",
                        help="budget of height x width x frames x steps per job (default: per model family)")
    limits.add_argument("--max-prompt-chars", type=int, default=20_000, metavar="N",
                        help="longest prompt or negative prompt, in characters")
    limits.add_argument("--max-adapters", type=int, default=8, metavar="N", help="adapters in one request")
    limits.add_argument("--job-timeout", type=float, default=3600.0, metavar="S",
                        help="a job running longer is stopped at its next step and failed (0: no limit)")
    limits.add_argument("--client-timeout", type=float, default=60.0, metavar="S",
                        help="time a client gets to send a request's headers, and again its body")
    serve.add_argument("--engine", choices=("local", "ray"), default="local",
                       help="local: one worker process; ray: a Ray Serve pool of replicas (docs/scaling.md)")
    serve.add_argument("--ray-address", metavar="ADDR",
                       help="a running Ray cluster (see `app.py ray-up`); default: a private local one")
    serve.add_argument("--replicas", type=int, default=1, metavar="N", help="--engine ray: pipeline replicas")
    serve.add_argument("--gpus-per-replica", type=float, default=0.0, metavar="G",
                       help="--engine ray: GPUs each replica reserves")
    _lora(serve)
    _common(serve)

    gen = sub.add_parser("generate", help="generate one image or video",
                         description="Generate one image or video on this machine (no server). Flags left "
                                     "unset use the model's defaults (a preset's, with --preset).",
                         formatter_class=DefaultsHelp)
    unset = "the model's default"
    gen.add_argument("--model", default=DEFAULT_MODEL, help="a demo id, a local diffusers directory or a "
                     "Hugging Face repo id in the local cache")
    gen.add_argument("--prompt", required=True, help="what to generate (required)")
    gen.add_argument("--negative-prompt", default=None, help="what to steer away from (Qwen: needs "
                     "--true-cfg-scale > 1)")
    gen.add_argument("--image", help="input image (image-to-video: the first frame; Qwen-Image and SD3.5: "
                     "img2img, the picture to start from)")
    gen.add_argument("--strength", type=float, help="img2img: how far from --image, in (0, 1] (default: 0.75)")
    gen.add_argument("--num-frames", type=int, metavar="N", help=f"video frames, Wan: 4k+1 (default: {unset})")
    gen.add_argument("--num-inference-steps", type=int, metavar="N",
                     help=f"denoising steps (default: {unset})")
    gen.add_argument("--height", type=int, metavar="PX", help=f"a multiple of 16 (default: {unset}; "
                     f"image-to-video: from the input image's aspect ratio)")
    gen.add_argument("--width", type=int, metavar="PX", help=f"a multiple of 16 (default: {unset}; "
                     f"image-to-video: from the input image's aspect ratio)")
    gen.add_argument("--fps", type=int, help=f"video frame rate (default: {unset})")
    gen.add_argument("--flow-shift", type=float, help=f"the flow-matching schedule's shift (default: {unset})")
    gen.add_argument("--sample-solver", choices=("euler", "unipc"), help=f"the sampler (default: {unset})")
    gen.add_argument("--guidance-scale", type=float, help=f"classifier-free guidance (default: {unset})")
    gen.add_argument("--guidance-scale-high", type=float,
                     help="Wan2.2: the second guidance scale (diffusers' guidance_scale_2), as in vLLM-Omni "
                          f"(default: {unset})")
    gen.add_argument("--boundary-ratio", type=float, help="Wan2.2: steps with t >= ratio x 1000 run on the "
                     f"high-noise transformer (default: {unset})")
    gen.add_argument("--true-cfg-scale", type=float, help=f"Qwen-Image: true CFG (default: {unset})")
    gen.add_argument("--task-type", choices=task_types(),
                     help="MiniMax-H3 workflow: text, first/last frame, or references to video+audio")
    gen.add_argument("--last-image", help="MiniMax-H3 fl2va: the frame the video ends on (--image: starts on)")
    gen.add_argument("--reference", action="append", metavar="PATH",
                     help="MiniMax-H3 ref2va: a reference image (repeat for several)")
    gen.add_argument("--audio-flow-shift", type=float, help="MiniMax-H3: the audio schedule's shift")
    gen.add_argument("--seed", type=int, default=42, help="-1 picks a random one (the one used is in the metadata)")
    gen.add_argument("--output", help="output path: .png, .jpg/.jpeg or .webp (metadata in EXIF) for images, "
                     ".mp4 for videos (default: <data-dir>/outputs/)")
    _lora(gen)
    _common(gen)

    adapters = sub.add_parser("adapters", help="list the adapter library and its fit for a model")
    adapters.add_argument("--model", help="report each adapter's fit against this model")
    _common(adapters)

    ray_up = sub.add_parser("ray-up", help="start a Ray head node on this machine; prints its address")
    ray_up.add_argument("--port", type=int, default=6379)
    ray_up.add_argument("--num-cpus", type=int, metavar="N")
    ray_up.add_argument("--num-gpus", type=int, metavar="N")

    hashpw = sub.add_parser("hash-password", help="print a USER:HASH line (scrypt) for --auth-file",
                            description="Read a password (typed without echo, or one line on stdin) and print "
                                        "USER:HASH, a line for --auth-file. The password is never an argument: "
                                        "other users of the machine could read it in `ps`.")
    hashpw.add_argument("user", metavar="USER")

    presets = sub.add_parser("presets", help="list distill presets and which files are present")
    _common(presets)

    export = _stack_command(sub, "export-lora", "write a stack of adapters as one LoRA file (its merge bit for bit; "
                                                "diffusers layout)",
                            "the model the stack is for", "FILE.safetensors", "the file to write")
    export.add_argument("--dtype", default="auto",
                        help="the dtype the model is served in (auto: bfloat16 with CUDA, else float32): where "
                             "adapters with different weights share a layer, the file is exact for that dtype")
    export.add_argument("--layout", choices=("diffusers", "kohya"), default="diffusers",
                        help="diffusers (transformer.<module>.lora_A/B, exact) or kohya (sd-scripts' lora_unet_ / "
                             "lora_te_ names with .alpha, as ComfyUI and A1111 read them; to fp32 rounding)")
    export.add_argument("--portable", action="store_true",
                        help="fold every layer's weight into its factors (scale 1, no per-layer alpha in the "
                             "header): for ComfyUI, A1111 and other readers of plain diffusers-layout files; exact "
                             "to fp32 rounding instead of bit for bit")
    _common(export)

    bake = _stack_command(sub, "bake", "write a copy of the model with a stack of adapters merged into its weights "
                                       "(a diffusers folder: --model DIR loads it)",
                          "the model to copy", "DIR", "the new model folder (must not exist)")
    bake.add_argument("--dtype", default="stored",
                      help="stored (each tensor's own dtype: the checkpoint's size unchanged), float32, bfloat16 or "
                           "float16: merge in the dtype the copy will be served in (bit for bit what the PEFT "
                           "backend merges there)")
    _common(bake)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    # `python app.py [MODEL] --flags` means serve.
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["serve", *argv]
    return build_parser().parse_args(argv)


GENERATION_FLAGS = {  # CLI flag (dest) -> generation field
    "negative_prompt": "negative_prompt", "image": "image", "num_frames": "num_frames",
    "num_inference_steps": "num_inference_steps", "height": "height", "width": "width", "fps": "fps",
    "flow_shift": "flow_shift", "sample_solver": "sample_solver", "guidance_scale": "guidance_scale",
    "guidance_scale_high": "guidance_scale_2", "boundary_ratio": "boundary_ratio",
    "true_cfg_scale": "true_cfg_scale", "seed": "seed",
    "task_type": "task_type", "last_image": "last_image", "reference": "references",
    "audio_flow_shift": "audio_flow_shift", "strength": "strength",
}


def runtime_config(args, **extra):
    """The start flags as the one start config (backend/config.py); a bad value exits 2 naming it."""
    from backend.config import RuntimeConfig

    return RuntimeConfig(model=getattr(args, "model", DEFAULT_MODEL), lora_paths=args.lora_path,
                         lora_backend=args.lora_backend, lora_scale=args.lora_scale, preset=args.preset,
                         device=args.device, dtype=args.dtype, data_dir=args.data_dir, adapter_dirs=args.adapter_dir,
                         offload=args.offload, offload_stream=args.offload_stream, pristine=args.pristine,
                         lora_mode=args.lora_mode, quantize=args.quantize, gguf=args.gguf, **extra)


def cmd_generate(args) -> int:
    from tqdm import tqdm

    from backend import Omni
    from backend.outputs import check_suffix

    if args.output:  # before the model loads, so a bad extension costs nothing
        check_suffix(args.output)
    from backend.jobs.adapters import AdapterResolver
    from backend.lora import prompt_tags

    prompt, tags = prompt_tags.split(args.prompt)  # <lora:NAME:WEIGHT>, as in the UI and the HTTP API
    resolver = AdapterResolver(args.adapter_dir, args.data_dir, model=args.model)
    tagged = [(a, resolver.by_name(a["name"])) for a in tags]  # unknown names refused before loading

    if args.lora_backend == "distill":
        _number_scale(args)
    omni = Omni(config=runtime_config(args))  # --preset: fused at start; its sampling defaults fill unset flags
    spec = getattr(omni.manager, "spec", None)
    if args.output and spec is not None:  # an image model cannot write .mp4, nor a video model .png
        check_suffix(args.output, video=str(spec.output).startswith("video"))
    fields = {field: getattr(args, flag) for flag, field in GENERATION_FLAGS.items()
              if getattr(args, flag) is not None}
    if args.lora_backend == "peft" and args.lora_path and omni.lora is not None:  # one-shot CLI: pre-loaded ones
        fields["lora_request"] = list(omni.lora.preloaded)
        fields["lora_scale"] = [args.lora_scale] * len(omni.lora.preloaded)
    if tagged:  # <lora:NAME:WEIGHT> in the prompt: adapters from the library, by name
        if omni.lora is None:
            from backend.errors import InvalidParameter

            raise InvalidParameter("prompt: <lora:...> tags need --lora-backend peft", param="prompt")
        from backend.lora.request import LoRARequest
        from backend.lora.sidecar import preferred_weight  # <lora:NAME>: its preferred weight, else 1.0

        for a, path in tagged:
            fields.setdefault("lora_request", []).append(LoRARequest(a["name"], resolver.int_id(path), str(path)))
            fields.setdefault("lora_scale", []).append(a["scale"] if "scale" in a else preferred_weight(path))
    bars = []

    def on_step(step, total):
        if not bars:  # created on the first step, so a rejected request prints no bar
            bars.append(tqdm(total=total, desc="denoising", unit="step", leave=False))
        bars[0].update(step - bars[0].n)

    try:
        output = omni.generate(prompt=prompt, on_step=on_step, **fields)[0]
    finally:
        for bar in bars:
            bar.close()
    path = output.save(args.output, data_dir=args.data_dir)
    print(path)
    if output.audio is not None:  # MiniMax-H3: the soundtrack also as WAV, beside the MP4
        from backend.minimax.media import write_wav

        print(write_wav(path.with_suffix(".wav"), output.audio))
    return 0


def cmd_serve(args) -> int:
    from backend.errors import InvalidParameter

    if args.share and not (args.auth or args.api_key or args.auth_file):  # a public link: every route needs one
        raise InvalidParameter("--share makes a public link: it needs --auth USER:PASS, --auth-file FILE or "
                               "--api-key KEY (then every route needs one)", param="share")
    if args.auth is not None and not all(args.auth.partition(":")[::2]):
        raise InvalidParameter("--auth must be USER:PASS", param="auth")
    from backend.api.auth import Credentials
    from backend.users import read_auth_file

    users = read_auth_file(args.auth_file) if args.auth_file else None
    credentials = Credentials(args.api_key, args.auth, users=users, admins=args.admin)  # checked before any load
    from backend.api import create_app, serve
    from backend.limits import Limits
    from backend.service import Studio

    if args.client_timeout <= 0:
        raise InvalidParameter(f"--client-timeout must be > 0 seconds, got {args.client_timeout}",
                               param="client_timeout")
    limits = Limits(max_side=args.max_side, max_frames=args.max_frames, max_work=args.max_work,
                    max_prompt_chars=args.max_prompt_chars, max_adapters=args.max_adapters,
                    job_timeout=args.job_timeout)
    _number_scale(args)
    if not args.model:  # the Settings tab's default model (backend/preferences.py), else the embedded one
        from backend import preferences

        args.model = preferences.load(args.data_dir).default_model
        if args.model:
            print(f"serving {args.model}: the default model in the settings "
                  f"({preferences.FILE} in the data dir)", file=sys.stderr, flush=True)
        args.model = args.model or DEFAULT_MODEL
    studio = Studio(args.model, data_dir=args.data_dir, adapter_dirs=args.adapter_dir,
                    lora_backend=args.lora_backend, lora_paths=args.lora_path, lora_scale=args.lora_scale,
                    preset=args.preset, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
                    max_queue=args.max_queue, device=args.device, dtype=args.dtype, engine=args.engine,
                    ray_address=args.ray_address, replicas=args.replicas, gpus_per_replica=args.gpus_per_replica,
                    offload=args.offload, offload_stream=args.offload_stream, limits=limits,
                    pristine=args.pristine, lora_mode=args.lora_mode, lora_prefetch=args.lora_prefetch,
                    max_batch=args.max_batch, quantize=args.quantize, gguf=args.gguf)
    try:
        studio.start()
        app = create_app(studio, credentials=credentials,  # one gate for API and UI
                         client_timeout=args.client_timeout)
        on_exit = [studio.stopping]  # Ctrl-C / SIGTERM: end open waits and streams, then close
        from ui import end_streams, mount

        mount(app, studio)  # last, so the API routes keep priority; it takes the app's credentials
        on_exit.append(lambda: end_streams(app))
        if args.share:
            _share_when_listening(args.host, args.port, app.state.auth.credentials)
        serve(app, host=args.host, port=args.port, on_exit=on_exit, client_timeout=args.client_timeout)
    finally:
        studio.close()
    return 0


def _share_when_listening(host: str, port: int, auth) -> None:
    """Open the public share tunnel (ui.share_link) once the server accepts connections."""
    import socket
    import threading
    import time

    from ui import share_link

    def tunnel():
        for _ in range(600):
            try:
                socket.create_connection((host, port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        try:
            print(f"public URL: {share_link(host, port, auth=auth)}", flush=True)
        except Exception as exc:  # offline, blocked: the local server keeps running
            print(f"error: could not open a share link: {exc}", file=sys.stderr, flush=True)

    threading.Thread(target=tunnel, name="share-tunnel", daemon=True).start()


def cmd_adapters(args) -> int:
    from backend import settings
    from backend.lora import list_adapters
    from backend.lora.library import format_rows

    for path in settings.retire_old_demo_layout(args.data_dir):  # an older version's demo files in the library
        print(f"removed {path} (demo files now live in <data-dir>/demo, outside your library)", file=sys.stderr)
    rows = list_adapters(args.model, args.adapter_dir, args.data_dir)
    print(format_rows(rows) if rows else "no adapters found in the library roots")
    if args.model:
        from backend.lora.pristine import describe

        print(describe(args.model, args.data_dir))
    return 0


def cmd_presets(args) -> int:
    from backend.presets import format_rows, list_presets

    print(format_rows(list_presets(args.data_dir, args.adapter_dir)))
    return 0


def cmd_export_lora(args) -> int:
    from pathlib import Path

    from backend.errors import InvalidParameter
    from backend.jobs.adapters import AdapterResolver
    from backend.lora.export import export_stack
    from backend.manager import pick_device, pick_dtype

    out = Path(args.output).expanduser()
    if out.suffix.lower() != ".safetensors":
        raise InvalidParameter(f"--output {args.output}: a LoRA is written as a .safetensors file", param="output")
    resolver = AdapterResolver(args.adapter_dir, args.data_dir, model=args.model)
    specs = _stack_specs(args.adapters, resolver)
    dtype = pick_dtype(args.dtype, pick_device("auto"))
    written = export_stack(resolver.resolve(specs), args.model, out, data_dir=args.data_dir, dtype=dtype,
                           portable=args.portable, layout=args.layout)
    exact = f"exact in {written['exact_in']}" if written["exact_in"] else \
        f"{args.layout} layout{', portable' if args.portable else ''} (to fp32 rounding)"
    print(f"wrote {written['path']}: {written['layers']} layers, rank up to {written['rank']}, {exact}, from " + " + ".join(f"{s['name']} x{s['scale']}" for s in written["from"]))
    return 0


def cmd_bake(args) -> int:
    from backend.jobs.adapters import AdapterResolver
    from backend.lora.bake import bake_stack

    from backend.manager import pick_device, pick_dtype

    resolver = AdapterResolver(args.adapter_dir, args.data_dir, model=args.model)
    dtype = None if args.dtype == "stored" else pick_dtype(args.dtype, pick_device("auto"))
    written = bake_stack(resolver.resolve(_stack_specs(args.adapters, resolver)), args.model, args.output,
                         data_dir=args.data_dir, dtype=dtype)
    print(f"wrote {written['path']}: {written['layers']} layers merged ({written['files']} weight file(s) "
          f"rewritten, the rest linked; merged in {written['dtype']}), from " + " + ".join(f"{s['name']} x{s['scale']}" for s in written["from"])
          + f"; run it with --model {written['path']}")
    return 0


def _stack_specs(items, resolver) -> list[dict]:
    """``NAME[:WEIGHT]`` arguments as a request's adapter list (a path names a file, as --lora-path takes it)."""
    from pathlib import Path

    specs = []
    for item in items:
        ref, _, weight = item.rpartition(":")
        try:
            spec = {"scale": float(weight)} if ref else {}
        except ValueError:
            ref, spec = item, {}
        ref = ref or item
        if Path(ref).expanduser().exists():  # a file the operator names, as --lora-path takes it
            spec["name"] = resolver.register_start_file(ref).name
        else:
            spec["name"] = ref
        specs.append(spec)
    return specs


def cmd_hash_password(args) -> int:
    import getpass

    from backend.errors import InvalidParameter
    from backend.users import NAME, hash_password

    if not NAME.fullmatch(args.user):
        raise InvalidParameter(f"user name {args.user[:80]!r}: letters, digits, _.@- (at most 64 characters)",
                               param="user")
    if sys.stdin.isatty():
        password = getpass.getpass(f"password for {args.user}: ")
        if getpass.getpass("again: ") != password:
            raise InvalidParameter("the two passwords differ", param="password")
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    print(f"{args.user}:{hash_password(password)}")
    return 0


def cmd_ray_up(args) -> int:
    from backend.engines.ray_engine import ray_up

    address = ray_up(port=args.port, num_cpus=args.num_cpus, num_gpus=args.num_gpus)
    print(address)
    print(f"serve on it: python app.py serve --engine ray --ray-address {address}; "
          f"other machines join with: ray start --address={address}; end it with: ray stop", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from backend.errors import StudioError

    handlers = {"generate": cmd_generate, "serve": cmd_serve, "adapters": cmd_adapters, "presets": cmd_presets,
                "ray-up": cmd_ray_up, "export-lora": cmd_export_lora, "bake": cmd_bake,
                "hash-password": cmd_hash_password}
    try:
        return handlers[args.command](args)
    except StudioError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
