"""decode.py's command line and its work: `DecodeCommand` (DecodeConfig's and ServeConfig's
flags generated from them, `settings_cli`, over a --decode-config file), the prompts, the model
and tokenizer the flags name, the decoding policy (`decoding.builders.build_decoder`: a generator,
or the serving engine with --max-batch), its completions through one call and one output path;
--serve hands over to `frontends.serve`."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Annotated

import numpy as np

from glm_jax.decoding.decode_config import DecodeConfig
from glm_jax.extras import require
from glm_jax.frontends import cli, settings_cli
from glm_jax.frontends.serve import serve, serve_config
from glm_jax.frontends.settings_cli import Processes, optional_value
from glm_jax.serving.serve_config import ServeConfig

tyro = require("tyro")     # the cli extra: an ImportError naming it where it is missing

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "default"
DESCRIPTION = "Generate text with a trained model: prefill with sparse attention, then decode from the KV cache."
DEFAULT_PROMPT = "import os\n\n\ndef read_lines(path):\n"


@dataclasses.dataclass(frozen=True)
class DecodeCommand:
    """decode.py's command line: the decode's settings (DecodeConfig), the server's (ServeConfig,
    with --serve), a --decode-config file they start from, and the prompts, model and output."""

    settings: DecodeConfig = DecodeConfig()
    serving: ServeConfig = ServeConfig()
    decode_config: Annotated[str | None, optional_value("FILE")] = None
    """the decode's settings as YAML (DecodeConfig's fields, FILE); flags given override them"""
    checkpoint: Annotated[str | None, optional_value("DIR")] = None
    """a model directory (config.yaml, params/, tokenizer.json; what train.py writes; default: checkpoints/default)"""
    hf_checkpoint: Annotated[str | None, optional_value("DIR")] = None
    """a Hugging Face checkpoint directory (config.json, *.safetensors; tokenizer.json for text)"""
    config: Annotated[str | None, optional_value("FILE")] = None
    """expected config; refused if the checkpoint's differs"""
    prompt: Annotated[str | None, optional_value("TEXT")] = None
    """prompt text (default: a Python function header)"""
    prompt_file: Annotated[str | None, optional_value("FILE")] = None
    """read the prompt from this file"""
    prompt_ids: Annotated[str | None, optional_value("IDS")] = None
    """the prompt as comma-separated token ids (prints ids)"""
    prompts_file: Annotated[str | None, optional_value("FILE")] = None
    """a batch: JSON lines, each a string or {"prompt": ...}; prompts may differ in length"""
    output: Annotated[str | None, optional_value("FILE")] = None
    """write {prompt, completion} JSON lines here"""
    quiet: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False
    """print only the generated text: no prompt, marker line or statistics (with --prompt-ids: the prompt's ids and
    the new ones, as without it)"""
    kernel_config: Annotated[tuple[str, ...], tyro.conf.UseAppendAction,
                             tyro.conf.arg(metavar="GROUP.FIELD=VALUE", help=cli.KERNEL_CONFIG_HELP)] = ()
    serve: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False
    """run the HTTP server: OpenAI-style /v1/completions requests (docs/serving.md) instead of decoding --prompt"""
    compile_only: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False
    """compile one decode step for --topology ahead of time and print per-chip memory"""
    topology: Annotated[str | None, optional_value("TOPOLOGY")] = None
    """TPU slice for --compile-only, e.g. v5p:4x4x4"""
    max_context: Annotated[int | None, optional_value("N")] = None
    """cache rows per sequence for --compile-only (default: the model's context)"""
    batch: int = 1
    """sequences per step for --compile-only"""
    processes: Processes = Processes()

    coordinator = property(lambda self: self.processes.coordinator)     # what cli.join_processes reads
    num_processes = property(lambda self: self.processes.num_processes)
    process_id = property(lambda self: self.processes.process_id)
    distributed = property(lambda self: self.processes.distributed)


def parse_args(argv=None) -> DecodeCommand:
    """decode.py's flags (DecodeConfig's and ServeConfig's generated from them) over the --decode-config file."""
    command = settings_cli.parse(DecodeCommand, argv, description=DESCRIPTION, settings_file="decode_config",
                                 load_file=_load_settings, deprecated={"--init-from-hf": "--hf-checkpoint"})
    if command.checkpoint and command.hf_checkpoint:
        raise cli.UserError("--checkpoint and --hf-checkpoint both name the model; give one")
    if not command.checkpoint and not command.hf_checkpoint:
        command = dataclasses.replace(command, checkpoint=str(DEFAULT_CHECKPOINT))
    return command


def _load_settings(path: str) -> DecodeConfig:
    import yaml

    from glm_jax.settings import SettingError, from_dict

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise SettingError(f"{path}: not YAML ({str(e).splitlines()[0]})") from None
    return from_dict(DecodeConfig, data, where=path)


@cli.reports_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_only:
        return _compile_only(args)
    with cli.user_errors():     # every number checked before the model loads
        settings = decode_config(args)
        serving = serve_config(args) if args.serve else None
    cli.join_processes(args, settings.mesh)      # before the first jax computation
    if serving is not None:
        return serve(args, settings, serving)
    from glm_jax.multihost import is_main_process, stdout_of_main_process_only

    with stdout_of_main_process_only():
        return _decode(args if is_main_process() else dataclasses.replace(args, quiet=True, output=None), settings)


def decode_config(args: DecodeCommand) -> DecodeConfig:
    """The DecodeConfig of decode.py's flags, its kernel_config from the --kernel-config items
    over the --decode-config file's."""
    settings = args.settings
    if args.kernel_config:
        settings = dataclasses.replace(settings, kernel_config=cli.kernel_config(list(args.kernel_config),
                                                                                 settings.kernel_config))
    return settings


def _decode(args, settings: DecodeConfig) -> int:
    # Imported here so that --help answers at once.
    from glm_jax.checkpoint import load_model
    from glm_jax.config import load_config
    from glm_jax.data.tokenizer import load_tokenizer, stop_token
    from glm_jax.decoding.builders import build_decoder
    import jax
    from flax import nnx

    from glm_jax.sharding import check_host_memory, make_mesh

    source = cli.model_source(args)
    with cli.user_errors():
        prompts = _read_prompts(args)
        model = load_model(source, config=load_config(args.config) if args.config else None)
        tok = _TokenIds() if args.prompt_ids else _load_tokenizer(source.path, load_tokenizer)
        ids = [np.asarray(tok.encode(p).ids, np.int32) for p in prompts]
        mesh = make_mesh(settings.mesh) if settings.mesh else None
        if mesh is not None:
            check_host_memory(mesh, sum(x.nbytes for x in jax.tree.leaves(nnx.state(model))))
        # --max-batch only changes the policy: the serving engine instead of a generator
        policy, choice = build_decoder(model, settings, ids, mesh=mesh)
        for row in ids:
            policy.check_prompt(row, settings.max_new_tokens)
    stop = stop_token(model.cfg, None if isinstance(tok, _TokenIds) else tok)
    served = settings.max_batch is not None
    if not args.quiet and not served:
        print(_header(policy, model, source, ids, settings), file=sys.stderr)
        print(choice.reason, file=sys.stderr)
    sampling = dict(max_new_tokens=settings.max_new_tokens, sampling=settings.sampling(), seed=settings.seed,
                    stop_token=stop, progress=None if args.quiet or served else _Progress())
    show = _prompt_shown(args)
    t0 = time.perf_counter()
    one = len(ids) == 1         # one prompt: its text printed as the tokens come
    completions = _complete(policy, ids, sampling, tok, show(prompts[0]) if one else None)
    if not one:
        _print_completions(prompts, completions, tok, show)
    _write_output(args.output, prompts, completions, tok)
    if not args.quiet:
        _print_stats(policy, settings, completions, time.perf_counter() - t0)
    return 0


def _header(gen, model, source, ids, settings: DecodeConfig) -> str:
    """The line that says what a generator decodes: model, prompts, plain or speculative, mesh,
    the cache's layout."""
    from glm_jax.decoding.speculative import SpeculativeGenerator

    mode = f"speculative, K={gen.num_draft}, KVShare {'on' if gen.kv_share else 'off'}" \
        if isinstance(gen, SpeculativeGenerator) else "plain"
    where = f"; mesh {settings.mesh}" + (" (KV cache LayerSplit)" if gen.split is not None else "") \
        if settings.mesh else ""
    return (f"model {model.cfg.name} from {source.path}; {len(ids)} prompt(s), {sum(map(len, ids))} tokens; "
            f"{mode} decoding{where}; KV cache {gen.cache_layout}")


def _prompt_shown(args):
    """How a prompt is printed before its completion: token ids in, token ids out
    (machine-readable) unmarked; text with its end marked (`display.prompt_text`)."""
    from glm_jax.decoding import display

    if args.prompt_ids:
        return lambda p: p
    if args.quiet:              # only the generated text
        return lambda p: ""
    return functools.partial(display.prompt_text, style=display.styled(sys.stdout))


def _print_completions(prompts, completions, tok, show) -> None:
    """Each prompt as `show` prints it and its completion (headed by its number when there are several)."""
    for i, (prompt, new) in enumerate(zip(prompts, completions)):
        if len(prompts) > 1:
            print(f"\n===== prompt {i} =====")
        print(show(prompt) + tok.decode(new), flush=True)


def _write_output(path, prompts, completions, tok) -> None:
    """{prompt, completion} JSON lines to `path` (None on every process but the first: nothing)."""
    if path:
        with open(path, "w") as f:
            for prompt, new in zip(prompts, completions):
                f.write(json.dumps({"prompt": prompt, "completion": tok.decode(new)}) + "\n")


class _TokenIds:
    """Stands in for a tokenizer when prompts are token ids: text is comma-separated ids."""

    class _Encoding:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text: str):
        try:
            return self._Encoding([int(t) for t in text.replace(",", " ").split()])
        except ValueError:
            raise ValueError(f"--prompt-ids: expected comma-separated integers, got {text!r}") from None

    def decode(self, ids) -> str:
        return "".join(f",{i}" for i in ids)


def _load_tokenizer(directory, load_tokenizer):
    try:
        return load_tokenizer(directory)
    except FileNotFoundError:
        raise FileNotFoundError(f"{directory} holds no tokenizer.json, so text prompts cannot be encoded; "
                                "give token ids with --prompt-ids 1,2,3 (or copy the model's tokenizer.json "
                                "there)") from None


def _compile_only(args) -> int:
    """Compile one decode step for a TPU slice from abstract params and report per-chip memory."""
    if args.settings.kv_cache_dtype != "auto":
        raise cli.UserError("--compile-only compiles the cache in the model's dtype; leave out --kv-cache-dtype")
    cli.choose_platforms()          # no TPU runtime needed: the compiler comes from libtpu itself
    from glm_jax.aot import collective_overlap, compile_decode_step, default_mesh_spec, memory_report, topology_devices
    from glm_jax.config import load_config

    if not args.config or not args.topology:
        raise cli.UserError("--compile-only needs --config (a model config) and --topology (e.g. v5p:4x4x4)")
    with cli.user_errors():
        cfg = load_config(args.config)
        chips = len(topology_devices(args.topology))
        mesh = args.settings.mesh or default_mesh_spec(chips)
        max_len = args.max_context or cfg.max_position_embeddings
        try:
            compiled = compile_decode_step(cfg, topology=args.topology, mesh_spec=mesh, batch=args.batch,
                                           max_len=max_len, collective=args.settings.collective,
                                           forward=decode_config(args).forward())
        except cli.USER_ERRORS:
            raise
        except Exception as e:          # the TPU compiler refusing the program, e.g. out of HBM
            print(f"{cfg.name} decode step, batch {args.batch}, {max_len} cache rows, mesh {mesh} on "
                  f"{args.topology}: does not compile: {str(e).splitlines()[0]}")
            return 1
    r = memory_report(compiled, args.topology)
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    print(f"{cfg.name} decode step, batch {args.batch}, {max_len} cache rows, mesh {mesh} on {args.topology} "
          f"({chips} chips); per chip: arguments (params + cache) {gib(r['arguments'])}, temporaries "
          f"{gib(r['temporaries'])}, outputs not aliased {gib(r['outputs_not_aliased'])}, code {gib(r['code'])}, "
          f"total {gib(r['total'])}" + ("" if r["hbm"] is None else
                                          f" of {gib(r['hbm'])} HBM: {'fits' if r['fits'] else 'does not fit'}"))
    overlap = collective_overlap(compiled)
    if overlap:
        print("async collectives with compute scheduled while they are in flight: " + ", ".join(
            f"{kind} {row['overlapped']} of {row['pairs']}" for kind, row in sorted(overlap.items())))
    return 0 if r["fits"] is not False else 1


def _read_prompts(args) -> list[str]:
    if args.prompt_ids:
        return [args.prompt_ids]
    if args.prompts_file:
        prompts = []
        for n, line in enumerate(_read_text(args.prompts_file).splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{args.prompts_file}:{n}: not JSON ({e.msg} at column {e.colno}); each line is "
                                 "a JSON string or {\"prompt\": \"...\"}") from None
            if isinstance(item, dict):
                item = item.get("prompt")
            if not isinstance(item, str):
                raise ValueError(f"{args.prompts_file}:{n}: expected a JSON string or {{\"prompt\": \"...\"}}")
            prompts.append(item)
        if not prompts:
            raise ValueError(f"{args.prompts_file} holds no prompts")
        return prompts
    if args.prompt_file:
        return [_read_text(args.prompt_file)]
    return [args.prompt if args.prompt is not None else DEFAULT_PROMPT]


def _read_text(path: str) -> str:
    """The UTF-8 text of `path`; a file that is not UTF-8 is an error naming it and the offset."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); "
                         "save the file as UTF-8") from None


def _complete(policy, ids, sampling, tok, shown_prompt: str | None = None) -> list[list[int]]:
    """Each prompt's new tokens from the policy (`completions`: the same call for a generator and
    the serving engine); with shown_prompt (one prompt), it and the text printed as tokens come."""
    new: list[list[int]] = [[] for _ in ids]
    printed = None
    if shown_prompt is not None:
        print(shown_prompt, end="", flush=True)
        printed = ""
    for pieces in policy.completions(ids, **sampling):
        for row, piece in zip(new, pieces):
            row += piece
        if printed is not None:
            text = tok.decode(new[0])
            print(text[len(printed):], end="", flush=True)
            printed = text
    if printed is not None:
        print(flush=True)
    return new


class _Progress:
    """What decode.py shows on stderr while it works: that the first call of each program compiles
    it (which takes most of a short run's time), a bar over the prompt tokens of a long prefill,
    and when decoding starts."""

    def __init__(self, bar_from_tokens: int = 512):
        from tqdm import tqdm

        self.tqdm, self.bar_from = tqdm, bar_from_tokens
        self.bar = None
        self.t0 = time.perf_counter()
        print("compiling and running the prefill (each program compiles on its first call) ...",
              file=sys.stderr, flush=True)

    def __call__(self, done: int, total: int) -> None:
        if self.t0 is not None:
            print(f"first prefill chunk done in {time.perf_counter() - self.t0:.1f} s (with compilation)",
                  file=sys.stderr, flush=True)
            self.t0 = None
            if total >= self.bar_from:
                self.bar = self.tqdm(total=total, unit="tok", desc="prefill", file=sys.stderr, leave=False)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
        if done >= total:
            if self.bar is not None:
                self.bar.close()
            print("prefill done; decoding (the first block compiles the decode program) ...", file=sys.stderr,
                  flush=True)


def _print_stats(policy, settings: DecodeConfig, completions, elapsed) -> None:
    from glm_jax.decoding import display

    s = policy.stats
    if settings.max_batch is not None:
        print(f"\n[{len(completions)} prompt(s) through the serving engine, {settings.max_batch} at a time: "
              f"{s.new_tokens} new tokens in {s.decode_s:.2f}s = {s.new_tokens / max(s.decode_s, 1e-9):.1f} tokens/s "
              f"(includes prefill and compilation)]", file=sys.stderr)
        return
    print(f"\n[prefill {s.prompt_tokens} tokens in {s.prefill_s:.2f}s; {sum(map(len, completions))} new tokens in "
          f"{s.decode_s or elapsed:.2f}s with compilation]", file=sys.stderr)
    print(display.steady_state_line(policy), file=sys.stderr)
