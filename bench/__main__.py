"""Benchmarks that print ratios against plain diffusers, measured side by side in one run.

    python -m bench lora [--switches 1000] [--threads 2] [--quick]
                                 [--only timing|disk|drift|switches|rss]
    python -m bench batch [--model demo:qwen-image] [--sizes 1,2,4,8] [--rounds 15] [--steps 4]
    python -m bench quant [--rounds 15] [--threads 2] [--quick]   (bench/quant.py)

``batch``: mixed-adapter batches (backend/batch.py) against the same requests one by one with merge
switching and against diffusers' per-adapter calls (``BatchBench``).

``lora``: a synthetic Wan transformer of realistic shape (hidden 768, 12 heads, FFN 3072,
4 layers, 1024 tokens, fp32) and 8 rank-32 adapters on every attention and FFN
projection, written to disk as diffusers-format files. The same files go through our
engine (exact merge, two-tier cache) and through diffusers used the way a user would
(``load_lora_adapter`` / ``set_adapters`` / ``fuse_lora`` / ``unfuse_lora`` /
``delete_adapters`` / hotswap). Paired measurements run in interleaved rounds and report
medians, so load from other processes on a shared machine hits both sides alike.
"""
from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


from bench.kit import _interleaved, _loadavg, _ms, _rotated, _stat  # noqa: E402,F401 (the shared harness)


class LoraBench:
    def __init__(self, args):
        self.args = args
        torch.manual_seed(0)
        self.model = self.build(args.width, args.layers)
        side = int(round((args.tokens ** 0.5) * 2))  # patch 2x2 over one latent frame
        g = torch.Generator().manual_seed(1)
        self.inputs = dict(hidden_states=torch.randn(1, 16, 1, side, side, generator=g),
                           timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, 64, 768, generator=g),
                           return_dict=False)
        self.tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
        self.paths = self._write_adapters()
        self.rows: list[tuple[str, str, str, str]] = []

    @staticmethod
    def build(width: int, layers: int, dtype=torch.float32):
        from diffusers import WanTransformer3DModel

        torch.manual_seed(0)
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=width // 128, attention_head_dim=128, in_channels=16,
            out_channels=16, text_dim=768, freq_dim=256, ffn_dim=4 * width, num_layers=layers, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=1024).to(dtype).eval()

    # -- setup -------------------------------------------------------------------------------------
    def _write_adapters(self, model=None, tag: str = "", count: int | None = None) -> list[Path]:
        from safetensors.torch import save_file

        names = [n for n, m in (model or self.model).named_modules() if isinstance(m, torch.nn.Linear)
                 and n.startswith("blocks.") and n.split(".", 2)[2] in (
                     "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                     "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")]
        paths = []
        r = self.args.rank
        for i in range(self.args.adapters if count is None else count):
            g = torch.Generator().manual_seed(10 + i)
            sd = {}
            for n in names:
                lin = (model or self.model).get_submodule(n)
                sd[f"transformer.{n}.lora_A.weight"] = torch.randn(r, lin.in_features, generator=g) / lin.in_features ** .5
                sd[f"transformer.{n}.lora_B.weight"] = torch.randn(lin.out_features, r, generator=g) * 0.02
            p = self.tmp / f"adapter{tag}-{i}.safetensors"
            save_file(sd, str(p))
            paths.append(p)
        return paths

    def forward(self, model):
        dtype = next(model.parameters()).dtype
        inputs = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v)
                  for k, v in self.inputs.items()}
        with torch.inference_mode():
            return model(**inputs)[0]

    def engine(self, model, **kw):
        from diffusers import WanPipeline

        from backend.lora.engine import LoRAEngine

        return LoRAEngine(WanPipeline, {"transformer": model}, model="bench-wan", **kw)

    def req(self, i):
        from backend.lora.request import LoRARequest

        return LoRARequest(f"adapter-{i}", i + 1, str(self.paths[i]))

    def add(self, what: str, ours: str, theirs: str, note: str = "") -> None:
        self.rows.append((what, ours, theirs, note))
        print(f"  {what}: ours {ours} | diffusers {theirs} | {note}", flush=True)

    def timed(self, what: str, ours: float, theirs: float, note: str = "") -> None:
        """A time pair with the ratio ours / diffusers."""
        self.add(what, _ms(ours), _ms(theirs), f"{ours / theirs:.3f}x" + (f" ({note})" if note else ""))

    # -- measurements --------------------------------------------------------------------------------
    def run(self):
        only = self.args.only
        print(f"load average {_loadavg()}; {torch.get_num_threads()} threads; model width {self.args.width}, "
              f"{self.args.layers} blocks, {self.args.tokens} tokens, rank {self.args.rank}", flush=True)
        if only in (None, "timing"):
            self.timing(torch.float32)
            self.timing(torch.bfloat16)
        if only in (None, "disk"):
            self.disk(*self._pair())
        if only in (None, "sweep"):
            self.sweep()
        if only in (None, "drift"):
            self.drift()
        if only in (None, "switches"):
            self.switches(self.model, torch.float32)
            self.switches(copy.deepcopy(self.model).to(torch.bfloat16), torch.bfloat16)
        if only in (None, "rss"):
            self.rss_diffusers()

    def _pair(self):
        """(our model, its engine, diffusers' model), each with adapters 0-3 resident and 0 active."""
        ours_model = copy.deepcopy(self.model)
        theirs_model = copy.deepcopy(self.model)
        engine = self.engine(ours_model, max_loras=4, max_cpu_loras=8)
        for i in range(4):
            engine.load(self.req(i))
            theirs_model.load_lora_adapter(str(self.paths[i]), adapter_name=f"a{i}", prefix="transformer")
        engine.activate([(self.req(0), 1.0)])
        theirs_model.set_adapters(["a0"], [1.0])
        return ours_model, engine, theirs_model

    def timing(self, dtype):
        """Side by side in rotated rounds (each round starts with the next side), so load that comes
        and goes hits every side alike: medians and min-max over >= 15 rounds."""
        a = self.args
        R = a.rounds
        label = str(dtype).replace("torch.", "")
        steps = a.steps
        base_model = copy.deepcopy(self.model).to(dtype)
        ours_model = copy.deepcopy(self.model).to(dtype)
        engine = self.engine(ours_model, max_loras=4, max_cpu_loras=8, pristine="device")
        resident = copy.deepcopy(self.model).to(dtype)  # all adapters resident + set_adapters
        for i in range(2):
            resident.load_lora_adapter(str(self.paths[i]), adapter_name=f"a{i}", prefix="transformer")
        hot = copy.deepcopy(self.model).to(dtype)  # hotswap=True: one adapter slot, weights swapped in place
        hot.enable_lora_hotswap(target_rank=a.rank)
        hot.load_lora_adapter(str(self.paths[0]), adapter_name="hot", prefix="transformer")
        low = copy.deepcopy(self.model).to(dtype)  # load_lora_adapter(low_cpu_mem_usage=True) per switch
        state = {"low": 0}

        def ours_switch(i):
            engine.activate([(self.req(i % 2), 1.0)])

        def resident_switch(i):
            resident.set_adapters([f"a{i % 2}"], [1.0])

        def hot_switch(i):
            hot.load_lora_adapter(str(self.paths[i % 2]), adapter_name="hot", prefix="transformer", hotswap=True)

        def low_switch(i):
            n = state["low"]
            low.load_lora_adapter(str(self.paths[n % 2]), adapter_name=f"l{n}", prefix="transformer",
                                  low_cpu_mem_usage=True)
            low.set_adapters([f"l{n}"], [1.0])
            if n:
                low.delete_adapters([f"l{n - 1}"])
            state["low"] = n + 1

        for fn in (ours_switch, resident_switch, hot_switch, low_switch):
            fn(1)  # round 0 then switches to adapter 0: every timed call is a real switch
        for m in (base_model, ours_model, resident, hot, low):
            self.forward(m)  # warm-up
        before = dict(engine.counters)
        sw = _rotated({"ours": ours_switch, "set_adapters": resident_switch, "hotswap": hot_switch,
                       "low_cpu_mem_usage": low_switch}, R)
        switches = engine.counters["switches"] - before["switches"]
        per_switch = (engine.counters["bytes_written"] - before["bytes_written"]) / max(1, switches)
        print(f"[{label}] switch medians: " + ", ".join(f"{k} {_ms(v[0])}" for k, v in sw.items()), flush=True)
        self.add(f"[{label}] switch between cached adapters ({per_switch / 2**20:.1f} MiB written per switch)",
                 _stat(sw["ours"]), f"set_adapters {_stat(sw['set_adapters'])}",
                 f"{sw['ours'][0] / sw['set_adapters'][0]:.2f}x set_adapters")
        ratio_hot = sw["ours"][0] / sw["hotswap"][0]
        self.add(f"[{label}] switch: ours (cached) vs hotswap=True (reads the file)", _stat(sw["ours"]),
                 f"hotswap {_stat(sw['hotswap'])}",
                 f"{ratio_hot:.2f}x; target <= 2x: {'met' if ratio_hot <= 2 else 'MISSED'}")
        self.add(f"[{label}] switch: ours (cached) vs load_lora_adapter(low_cpu_mem_usage=True)+set+delete",
                 _stat(sw["ours"]), f"low_cpu_mem {_stat(sw['low_cpu_mem_usage'])}",
                 f"{sw['ours'][0] / sw['low_cpu_mem_usage'][0]:.2f}x")

        def gen(model, switch):
            def run(i):
                if switch is not None:
                    switch(i)
                for _ in range(steps):
                    self.forward(model)
            return run

        g = _rotated({"base": gen(base_model, None), "ours": gen(ours_model, ours_switch),
                      "set_adapters": gen(resident, resident_switch), "hotswap": gen(hot, hot_switch)}, R)
        ratio = g["ours"][0] / g["base"][0]
        self.add(f"[{label}] {steps}-step generation at {a.tokens} tokens, a switch every request, vs base "
                 f"(base {_stat(g['base'])})", f"{ratio:.3f}x ({_stat(g['ours'])})",
                 f"set_adapters {g['set_adapters'][0] / g['base'][0]:.3f}x, hotswap "
                 f"{g['hotswap'][0] / g['base'][0]:.3f}x", f"target <= 1.05x: {'met' if ratio <= 1.05 else 'MISSED'}")
        del base_model, ours_model, engine, resident, hot, low
        gc.collect()

    def sweep(self):
        """Switch time vs bytes written: the same adapters' layout over models of growing width (fp32)."""
        a = self.args
        points = []
        for width in a.sweep:
            model = self.build(width, 2)
            paths = self._write_adapters(model, tag=f"-w{width}", count=2)
            engine = self.engine(model, max_loras=2, max_cpu_loras=2, pristine="device")
            from backend.lora.request import LoRARequest

            reqs = [LoRARequest(f"w{width}-{i}", i + 1, str(p)) for i, p in enumerate(paths)]
            engine.activate([(reqs[0], 1.0)])
            engine.activate([(reqs[1], 1.0)])  # round 0 switches back to 0
            before = dict(engine.counters)
            t = _rotated({"s": lambda i: engine.activate([(reqs[i % 2], 1.0)])}, a.rounds)["s"]
            nbytes = (engine.counters["bytes_written"] - before["bytes_written"]) / a.rounds
            points.append((nbytes, t[0]))
            self.add(f"switch vs bytes: width {width}, 2 blocks, fp32", f"{_stat(t)} for {nbytes / 2**20:.1f} MiB",
                     "-", f"{nbytes / t[0] / 2**30:.2f} GiB/s written")
            del model, engine
            gc.collect()
        if len(points) >= 2:
            xs, ys = [p[0] / 2**20 for p in points], [p[1] * 1e3 for p in points]
            mx, my = statistics.mean(xs), statistics.mean(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            self.add("switch time vs MiB written (least squares)", f"{my - slope * mx:.2f} ms + {slope:.3f} ms/MiB",
                     "-", f"{1 / slope:.2f} GiB/s" if slope > 0 else "-")

    def disk(self, ours_model, engine, theirs_model):
        """Activating an adapter that is only on disk: ours vs load_lora_adapter + set_adapters + delete_adapters.

        Both sides read the same four files (adapters 4-7, in turn) through the page cache, in
        interleaved rounds. Ours is measured cold: its sha256 cache entry is dropped first, so
        every measured activation reads, hashes, checks, converts, fits and merges.
        """
        from backend.cpu_tasks import single_threaded
        from backend.lora import formats
        from backend.lora.convert import convert
        from backend.lora.fit import fit

        rounds = max(8, self.args.switch_repeats)
        theirs_parts = {"load_lora_adapter": [], "set_adapters": [], "delete_adapters": []}

        def ours_disk(i):
            k = 4 + i % 4
            if (k + 1) in engine.cache.cpu:  # make it a real disk load every time
                engine.unload(k + 1)
            formats.forget_sha256(self.paths[k])
            engine.activate([(self.req(k), 1.0)])

        def theirs_disk(i):
            k = 4 + i % 4
            t0 = time.perf_counter()
            theirs_model.load_lora_adapter(str(self.paths[k]), adapter_name=f"d{i}", prefix="transformer")
            t1 = time.perf_counter()
            theirs_model.set_adapters([f"d{i}"], [1.0])
            t2 = time.perf_counter()
            theirs_model.delete_adapters([f"d{i - 1}"] if i else ["a3"])
            t3 = time.perf_counter()
            for part, dt in zip(theirs_parts, (t1 - t0, t2 - t1, t3 - t2)):
                theirs_parts[part].append(dt)

        def read_bytes(i):
            self.paths[4 + i % 4].read_bytes()

        t = _interleaved({"ours": ours_disk, "theirs": theirs_disk, "read": read_bytes}, rounds)
        theirs_model.delete_adapters([f"d{rounds - 1}"])
        self.timed(f"switch that loads from disk (reading the file's bytes alone {_ms(t['read'])})",
                   t["ours"], t["theirs"], "target <= 1x: " + ("met" if t["ours"] <= t["theirs"] else "MISSED"))

        # where the time goes: our steps one by one (as the engine runs them), diffusers' calls as timed above
        def read(i):
            formats.forget_sha256(self.paths[4 + i % 4])
            with single_threaded():
                return formats.read_tensors(self.paths[4 + i % 4])

        def convert_fit(i):
            with single_threaded():
                fit(convert(raw, engine.pipeline_cls), engine.denoisers, adapter="x", file="x")

        raw = read(0)
        raw_bytes = self.paths[4].read_bytes()
        steps = _interleaved({"read": read, "sha256": lambda i: hashlib.sha256(raw_bytes).hexdigest(),
                              "convert+fit": convert_fit,
                              "merge": lambda i: engine.activate([(self.req(i % 2), 1.0)])}, rounds)
        med = {k: statistics.median(v) for k, v in theirs_parts.items()}
        self.add("disk switch, step by step (medians)",
                 f"read + checks {_ms(steps['read'])} (sha256 alone {_ms(steps['sha256'])}), convert + fit "
                 f"{_ms(steps['convert+fit'])}, merge {_ms(steps['merge'])}",
                 ", ".join(f"{k} {_ms(v)}" for k, v in med.items()))

        # hotswap, for reference
        def theirs_hot(i):
            theirs_model.load_lora_adapter(str(self.paths[1 + i % 2]), adapter_name="a0", prefix="transformer",
                                           hotswap=True)

        try:
            hot = _interleaved({"ours": ours_disk, "theirs": theirs_hot}, max(4, rounds // 2))
            self.timed("our disk switch vs diffusers hotswap (load_lora_adapter hotswap=True)", hot["ours"],
                       hot["theirs"])
        except Exception as exc:  # noqa: BLE001 - report, don't fail the table
            self.add("diffusers hotswap", "-", f"failed: {exc}")

    def drift(self):
        """bf16: diffusers' fuse/unfuse arithmetic vs our restore from the pristine copy."""
        cycles = 20
        theirs = copy.deepcopy(self.model).to(torch.bfloat16)
        w0 = {n: p.detach().clone() for n, p in theirs.named_parameters()}
        for i in range(2):
            theirs.load_lora_adapter(str(self.paths[i]), adapter_name=f"a{i}", prefix="transformer")
        for c in range(cycles):
            name = f"a{c % 2}"
            theirs.set_adapters([name], [1.0])
            theirs.fuse_lora(adapter_names=[name])
            theirs.unfuse_lora()
        base_names = {n: n.replace(".base_layer", "") for n, _ in theirs.named_parameters() if "lora_" not in n}
        num = den = 0.0
        for n, p in theirs.named_parameters():
            if "lora_" in n:
                continue
            ref = w0[base_names[n]].float()
            num += float((p.detach().float() - ref).pow(2).sum())
            den += float(ref.pow(2).sum())
        theirs_drift = (num / den) ** 0.5
        ours = copy.deepcopy(self.model).to(torch.bfloat16)
        from backend.weights import module_checksum

        pristine = module_checksum(ours)
        engine = self.engine(ours, max_loras=2, max_cpu_loras=2)
        for c in range(cycles):
            engine.activate([(self.req(c % 2), 1.0)])
            engine.activate([])
        same = module_checksum(ours) == pristine
        self.add(f"bf16 relative weight drift after {cycles} alternating switches",
                 "0 (sha256 equal)" if same else "DRIFTED", f"{theirs_drift:.2e} (fuse/unfuse)",
                 "exact: met" if same else "MISSED")
        del theirs, ours, engine
        gc.collect()

    def switches(self, model, dtype):
        """N random switches among all adapters, both tiers, stacking included: checksum and RSS."""
        from backend.weights import module_checksum

        n = self.args.switches
        pristine = module_checksum(model)
        engine = self.engine(model, max_loras=3, max_cpu_loras=5)
        rng = random.Random(0)
        count = len(self.paths)
        rss10 = None
        t = time.perf_counter()
        for i in range(n):
            k = rng.choice([0, 1, 1, 1, 2])
            chosen = rng.sample(range(count), k)
            engine.activate([(self.req(j), rng.choice([0.5, 1.0, 1.5])) for j in chosen])
            if i == 9:
                gc.collect()
                rss10 = _rss_mib()
        engine.activate([])
        elapsed = time.perf_counter() - t
        gc.collect()
        rss_end = _rss_mib()
        same = module_checksum(model) == pristine
        s = engine.stats()
        label = str(dtype).replace("torch.", "")
        growth = (rss_end - rss10) / rss10
        self.add(f"{n} random switches ({label}; stacking; {count} adapters; tiers 3 device / 5 cpu)",
                 f"base sha256 {'equal' if same else 'DIFFERENT'}; RSS after 10 {rss10:.0f} MiB, after {n} "
                 f"{rss_end:.0f} MiB ({growth * 100:+.2f}%)", "-",
                 f"{'met' if same and abs(growth) <= 0.02 else 'MISSED'} ({_ms(elapsed / n)}/switch, "
                 f"{s['counters']['loads_from_disk']} disk loads, "
                 f"{s['tiers']['cpu']['evictions']}+{s['tiers']['device']['evictions']} evictions)")

    def rss_diffusers(self):
        """RSS after repeated load/delete in diffusers, for reference."""
        theirs = copy.deepcopy(self.model)
        theirs.load_lora_adapter(str(self.paths[0]), adapter_name="x0", prefix="transformer")
        gc.collect()
        start = _rss_mib()
        for i in range(1, 51):
            theirs.load_lora_adapter(str(self.paths[i % len(self.paths)]), adapter_name=f"x{i}", prefix="transformer")
            theirs.set_adapters([f"x{i}"], [1.0])
            theirs.delete_adapters([f"x{i - 1}"])
        gc.collect()
        end = _rss_mib()
        self.add("RSS growth over 50 load/set/delete switches", "-", f"{end - start:+.1f} MiB")

    def table(self) -> str:
        head = ("measurement", "ours", "diffusers", "ratio / target")
        rows = [head] + self.rows
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
        return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                         + [line(r) for r in self.rows])


class BatchBench:
    """``batch``: throughput of N mixed-adapter requests (N = 1, 2, 4, 8; request i uses set i mod 3 of
    {adapter A, adapter B, no adapter}) on a demo pipeline, three ways, in rotated rounds:

    - batched: one ``generate_batch`` call (per-sample low-rank hooks, backend/batch.py);
    - one by one: ``PipelineManager.generate`` per request, merge switching between them (the engine's
      exact merge, our single-request path);
    - diffusers: both adapters resident in the pipeline (``load_lora_weights``), one pipeline call per
      adapter group with ``set_adapters`` (``disable_lora`` for the no-adapter group), diffusers' own way
      of serving several adapters."""

    def __init__(self, args):
        from backend.lora import attach, demo_adapters
        from backend.lora.request import LoRARequest
        from backend.manager import PipelineManager

        self.args = args
        data_dir = args.data_dir or tempfile.mkdtemp(prefix="lora-studio-bench-")
        library = demo_adapters.ensure(data_dir) / args.model.split(":", 1)[1]
        files = [p for p in sorted(library.glob("*.safetensors"))][:2]
        if len(files) < 2:
            raise SystemExit(f"{library}: the demo library has fewer than 2 adapter files for {args.model}")
        self.ours = PipelineManager(device="cpu", dtype="float32", data_dir=data_dir)
        self.ours.load(args.model)
        attach(self.ours, max_loras=4)
        self.theirs = PipelineManager(device="cpu", dtype="float32", data_dir=data_dir)
        self.theirs.load(args.model)
        for k, f in enumerate(files):
            self.theirs.pipeline.load_lora_weights(str(f), adapter_name=f"a{k}")
        self.sets = [[(LoRARequest(f.stem, k + 1, str(f)), 1.0)] for k, f in enumerate(files)] + [[]]
        self.files = files

    def requests(self, n: int, r: int):
        return [({"prompt": f"request {i} of round {r}", "seed": 1000 * r + i,
                  "num_inference_steps": self.args.steps, "height": self.args.size, "width": self.args.size},
                 i % len(self.sets)) for i in range(n)]

    def batched(self, n: int, r: int):
        from backend.batch import generate_batch

        reqs = self.requests(n, r)
        generate_batch(self.ours, [q for q, _ in reqs], [self.sets[k] for _, k in reqs])

    def one_by_one(self, n: int, r: int):
        for q, k in self.requests(n, r):
            self.ours.generate(q, adapters=self.sets[k], lora_mode="merge")

    def diffusers(self, n: int, r: int):
        m = self.theirs
        groups: dict[int, list] = {}
        for q, k in self.requests(n, r):
            groups.setdefault(k, []).append(m.validate(q))
        pipe = m.pipeline
        for k, params in groups.items():
            if self.sets[k]:
                pipe.enable_lora()
                pipe.set_adapters([f"a{k}"], [1.0])
            else:
                pipe.disable_lora()
            kwargs = {key: v for key, v in params[0].items() if key not in ("seed", "prompt")}
            with torch.inference_mode():
                pipe(prompt=[p["prompt"] for p in params], **kwargs,
                     generator=[torch.Generator().manual_seed(p["seed"]) for p in params], output_type="pil")

    def run(self) -> list[tuple]:
        rows = []
        for n in self.args.sizes:
            self.batched(n, 0), self.one_by_one(n, 0), self.diffusers(n, 0)  # warm-up
            t = _rotated({"batched": lambda r, n=n: self.batched(n, r + 1),
                          "one_by_one": lambda r, n=n: self.one_by_one(n, r + 1),
                          "diffusers": lambda r, n=n: self.diffusers(n, r + 1)}, self.args.rounds)
            rows.append((n, t))
            tput = {k: n / v[0] for k, v in t.items()}
            print(f"N={n}: batched {_stat(t['batched'])}, one by one (merge switching) {_stat(t['one_by_one'])}, "
                  f"diffusers per-adapter calls {_stat(t['diffusers'])}; throughput batched / one by one "
                  f"{tput['batched'] / tput['one_by_one']:.2f}x, batched / diffusers "
                  f"{tput['batched'] / tput['diffusers']:.2f}x (load average {_loadavg()})", flush=True)
        return rows

    def table(self, rows) -> str:
        out = ["| N | batched (median [min-max]) | one by one, merge switching | diffusers, per-adapter calls | "
               "batched / one by one | batched / diffusers |", "|---|---|---|---|---|---|"]
        for n, t in rows:
            out.append(f"| {n} | {_stat(t['batched'])} | {_stat(t['one_by_one'])} | {_stat(t['diffusers'])} | "
                       f"{t['one_by_one'][0] / t['batched'][0]:.2f}x | {t['diffusers'][0] / t['batched'][0]:.2f}x |")
        return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    sub = parser.add_subparsers(dest="what", required=True)
    lora = sub.add_parser("lora", help="PEFT engine vs plain diffusers")
    lora.add_argument("--threads", type=int, default=2)
    lora.add_argument("--width", type=int, default=1024, help="model width (a multiple of 128)")
    lora.add_argument("--layers", type=int, default=4)
    lora.add_argument("--tokens", type=int, default=256, help="tokens per pass (256 = a 256x256 image)")
    lora.add_argument("--steps", type=int, default=4, help="denoising steps per generation")
    lora.add_argument("--rank", type=int, default=32)
    lora.add_argument("--adapters", type=int, default=8)
    lora.add_argument("--rounds", type=int, default=15, help="rotated rounds per comparison (median, min-max)")
    lora.add_argument("--switch-repeats", type=int, default=16, help="rounds of the disk-switch rows")
    lora.add_argument("--sweep", type=lambda v: [int(x) for x in v.split(",")], default=[512, 1024, 1536, 2048],
                      help="model widths for the switch-time-vs-bytes sweep")
    lora.add_argument("--switches", type=int, default=1000, help="random switches for the checksum/RSS run")
    lora.add_argument("--only", choices=["timing", "disk", "sweep", "drift", "switches", "rss"],
                      help="run one section")
    lora.add_argument("--quick", action="store_true",
                      help="a smoke run: width 256, 1 block, 64 tokens, 5 rounds, sweep 256,512, 50 switches")
    batch = sub.add_parser("batch", help="mixed-adapter batches vs one by one vs diffusers' per-adapter calls")
    batch.add_argument("--model", default="demo:qwen-image")
    batch.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 4, 8],
                       help="batch sizes N (requests per round)")
    batch.add_argument("--rounds", type=int, default=15, help="rotated rounds per N (median, min-max)")
    batch.add_argument("--steps", type=int, default=4)
    batch.add_argument("--size", type=int, default=64, help="image height and width")
    batch.add_argument("--threads", type=int, default=1)
    batch.add_argument("--data-dir", help="where the demo model and adapters are built (default: a temp dir)")
    from bench import quant as bench_quant  # `quant`: a LoRA on fp8 / GGUF bases (bench/quant.py)

    bench_quant.add_parser(sub)
    args = parser.parse_args(argv)
    if args.what == "quant":
        if args.quick:
            args.width, args.layers, args.tokens, args.rounds = 256, 1, 64, 3
        torch.set_num_threads(args.threads)
        from backend.manager import quiet_libraries

        quiet_libraries()
        return bench_quant.run(args)
    if args.what == "batch":
        torch.set_num_threads(args.threads)
        from backend.manager import quiet_libraries

        quiet_libraries()
        bench = BatchBench(args)
        print(f"{args.model}, {args.size}x{args.size}, {args.steps} steps, fp32 CPU, {args.threads} threads; "
              f"request i uses set i mod 3 of [{bench.files[0].stem}, {bench.files[1].stem}, none]; "
              f"{args.rounds} rotated rounds; load average at start {_loadavg()}", flush=True)
        rows = bench.run()
        print()
        print(bench.table(rows))
        print(f"times are per round of N requests; ratios are throughput (N / median time). "
              f"load average at the end: {_loadavg()}")
        return 0
    if args.quick:
        args.width, args.layers, args.tokens, args.rounds, args.switch_repeats = 256, 1, 64, 5, 4
        args.sweep, args.switches = [256, 512], 50
    torch.set_num_threads(args.threads)
    from backend.manager import quiet_libraries

    quiet_libraries()
    bench = LoraBench(args)
    bench.run()
    print()
    print(bench.table())
    print(f"load average at the end: {_loadavg()}")
    print()
    from bench.costmodel import table as cost_table

    print(cost_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
