"""Benchmarks that print ratios against plain diffusers, measured side by side in one run.

    python -m backend.bench lora [--switches 1000] [--threads 2] [--quick]
                                 [--only timing|disk|drift|switches|rss]

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


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.2f} s"


def _mean_time(fn, repeats: int) -> float:
    t = time.perf_counter()
    for i in range(repeats):
        fn(i)
    return (time.perf_counter() - t) / repeats


def _interleaved(fns: dict, rounds: int) -> dict:
    """Median seconds of each ``fn(i)``, called in turn round by round, so load that comes and
    goes on a shared machine hits every side alike (back-to-back blocks would not)."""
    times = {k: [] for k in fns}
    for i in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn(i)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


class LoraBench:
    def __init__(self, args):
        from diffusers import WanTransformer3DModel

        self.args = args
        torch.manual_seed(0)
        self.model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=64, in_channels=16, out_channels=16,
            text_dim=768, freq_dim=256, ffn_dim=3072, num_layers=args.layers, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=1024).eval()
        side = int(round((args.tokens ** 0.5) * 2))  # patch 2x2 over one latent frame
        g = torch.Generator().manual_seed(1)
        self.inputs = dict(hidden_states=torch.randn(1, 16, 1, side, side, generator=g),
                           timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, 64, 768, generator=g),
                           return_dict=False)
        self.tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
        self.paths = self._write_adapters()
        self.rows: list[tuple[str, str, str, str]] = []

    # -- setup -------------------------------------------------------------------------------------
    def _write_adapters(self) -> list[Path]:
        from safetensors.torch import save_file

        names = [n for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)
                 and n.startswith("blocks.") and n.split(".", 2)[2] in (
                     "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                     "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")]
        paths = []
        r = self.args.rank
        for i in range(self.args.adapters):
            g = torch.Generator().manual_seed(10 + i)
            sd = {}
            for n in names:
                lin = self.model.get_submodule(n)
                sd[f"transformer.{n}.lora_A.weight"] = torch.randn(r, lin.in_features, generator=g) / lin.in_features ** .5
                sd[f"transformer.{n}.lora_B.weight"] = torch.randn(lin.out_features, r, generator=g) * 0.02
            p = self.tmp / f"adapter-{i}.safetensors"
            save_file(sd, str(p))
            paths.append(p)
        return paths

    def forward(self, model):
        with torch.inference_mode():
            return model(**self.inputs)[0]

    def engine(self, model, **kw):
        from diffusers import WanPipeline

        from .lora.engine import LoRAEngine

        return LoRAEngine(WanPipeline, {"transformer": model}, model="bench-wan", **kw)

    def req(self, i):
        from .lora.request import LoRARequest

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
        if only in (None, "timing"):
            self.timing()
        if only == "disk":
            self.disk(*self._pair())
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

    def timing(self):
        """Side by side, interleaved round by round so a busy machine slows all three alike."""
        a = self.args
        R = a.repeats
        base_model = self.model
        ours_model, engine, theirs_model = self._pair()
        for m in (base_model, ours_model, theirs_model):
            self.forward(m)  # warm-up
        rounds = {"base": [], "ours": [], "theirs": []}
        for _ in range(R):
            for key, m in (("base", base_model), ("ours", ours_model), ("theirs", theirs_model)):
                rounds[key].append(_median_time(lambda: self.forward(m), 1))
        t_base, t_ours_fwd, t_theirs_fwd = (statistics.median(rounds[k]) for k in ("base", "ours", "theirs"))
        print(f"base forward: {t_base:.3f} s ({a.tokens} tokens, {a.layers} layers, fp32, "
              f"{torch.get_num_threads()} threads)", flush=True)
        self.add("forward with an active adapter, relative to the base forward", f"{t_ours_fwd / t_base:.3f}x",
                 f"{t_theirs_fwd / t_base:.3f}x (unfused)", f"{t_ours_fwd / t_theirs_fwd:.3f}x")

        # a 4-step generation with a cached adapter, switch included (adapters alternate, so each one switches)
        steps = 4
        flip = {"i": 0}

        def base_gen():
            for _ in range(steps):
                self.forward(base_model)

        def ours_gen():
            engine.activate([(self.req(flip["i"]), 1.0)])
            for _ in range(steps):
                self.forward(ours_model)

        def theirs_gen():
            theirs_model.set_adapters([f"a{flip['i']}"], [1.0])
            for _ in range(steps):
                self.forward(theirs_model)

        gens = {"base": [], "ours": [], "theirs": []}
        for _ in range(R):
            flip["i"] ^= 1
            for key, fn in (("base", base_gen), ("ours", ours_gen), ("theirs", theirs_gen)):
                gens[key].append(_median_time(fn, 1))
        t_gen_base, t_gen_ours, t_gen_theirs = (statistics.median(gens[k]) for k in ("base", "ours", "theirs"))
        ratio = t_gen_ours / t_gen_base
        self.add(f"{steps}-step generation, cached adapter, switch included, relative to base",
                 f"{ratio:.3f}x", f"{t_gen_theirs / t_gen_base:.3f}x (unfused)",
                 f"target <= 1.05x: {'met' if ratio <= 1.05 else 'MISSED'}")

        # switching between resident adapters
        n = a.switch_repeats
        sw = _interleaved({"ours": lambda i: engine.activate([(self.req(i % 2), 1.0)]),
                           "theirs": lambda i: theirs_model.set_adapters([f"a{i % 2}"], [1.0])}, n)
        self.timed("switch between resident adapters (merge vs set_adapters)", sw["ours"], sw["theirs"])

        # a repeat request does no switching work
        engine.activate([(self.req(0), 1.0)])
        before = dict(engine.counters)
        t_repeat = _mean_time(lambda i: engine.activate([(self.req(0), 1.0)]), n)
        after = engine.counters
        work = after["layers_written"] - before["layers_written"] + after["switches"] - before["switches"]
        self.add("repeat request, same adapter: layers written + switches", f"{work} ({_ms(t_repeat)})",
                 f"{_ms(sw['theirs'])} (set_adapters)", "no work: met" if work == 0 else "WORK DONE: MISSED")

        self.disk(ours_model, engine, theirs_model)

        theirs_model.set_adapters(["a1"], [1.0])

        def theirs_fuse(i):
            theirs_model.fuse_lora(adapter_names=["a1"])
            theirs_model.unfuse_lora()

        fuse = _interleaved({"ours": lambda i: (engine.activate([(self.req(1), 1.0)]), engine.activate([])),
                             "theirs": theirs_fuse}, max(4, n // 5))
        self.timed("merge + restore vs fuse_lora + unfuse_lora", fuse["ours"], fuse["theirs"])
        del theirs_model, ours_model, engine
        gc.collect()

    def disk(self, ours_model, engine, theirs_model):
        """Activating an adapter that is only on disk: ours vs load_lora_adapter + set_adapters + delete_adapters.

        Both sides read the same four files (adapters 4-7, in turn) through the page cache, in
        interleaved rounds. Ours is measured cold: its sha256 cache entry is dropped first, so
        every measured activation reads, hashes, checks, converts, fits and merges.
        """
        from .cpu_tasks import single_threaded
        from .lora import formats
        from .lora.convert import convert
        from .lora.fit import fit

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
        from .weights import module_checksum

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
        from .weights import module_checksum

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.bench")
    sub = parser.add_subparsers(dest="what", required=True)
    lora = sub.add_parser("lora", help="PEFT engine vs plain diffusers")
    lora.add_argument("--threads", type=int, default=2)
    lora.add_argument("--layers", type=int, default=4)
    lora.add_argument("--tokens", type=int, default=1024)
    lora.add_argument("--rank", type=int, default=32)
    lora.add_argument("--adapters", type=int, default=8)
    lora.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (median)")
    lora.add_argument("--switch-repeats", type=int, default=20)
    lora.add_argument("--switches", type=int, default=1000, help="random switches for the checksum/RSS run")
    lora.add_argument("--only", choices=["timing", "disk", "drift", "switches", "rss"],
                      help="run one section (disk: the disk-switch rows of timing, alone)")
    lora.add_argument("--quick", action="store_true", help="a small smoke run (1 layer, 256 tokens, 50 switches)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.tokens, args.switches, args.repeats, args.switch_repeats = 1, 256, 50, 1, 4
    torch.set_num_threads(args.threads)
    from .manager import quiet_libraries

    quiet_libraries()
    bench = LoraBench(args)
    bench.run()
    print()
    print(bench.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
