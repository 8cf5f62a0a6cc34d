"""``qc.compile()``: capture → passes → backend, returning a model called like the original."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.fx import GraphModule

from qcompiler.compile_options import CompileOptions, compile_options
from qcompiler.distributed.ranks import current_ranks
from qcompiler.errors import CalibrationError
from qcompiler.export_formats import ExportOptions, export_format
from qcompiler.frontend import lazy_weights
from qcompiler.frontend.capture import CaptureInfo, capture, fill_optional_inputs, normalize_inputs
from qcompiler.frontend.causal_lm import (
    CacheLayout,
    check_mask_values,
    example_graph_inputs,
    graph_inputs,
    wrap_output,
)
from qcompiler.generation import SamplingConfig, generate_tokens
from qcompiler.pipeline.heartbeat import heartbeat
from qcompiler.pipeline.pass_base import PassContext, progress_line
from qcompiler.pipeline.pass_manager import PassManager
from qcompiler.pipeline.recipe_files import resolve_recipe
from qcompiler.pipeline.recipes import Recipe
from qcompiler.pipeline.report import Report
from qcompiler.pipeline.run_checkpoint import RunCheckpoint, run_fingerprint
from qcompiler.store import artifact

__all__ = ["compile", "load", "CompiledModel", "normalize_calibration"]


def _sampling(
    sampling: Optional[SamplingConfig], do_sample: bool, temperature: float, top_k: int, top_p: float
) -> SamplingConfig:
    """One ``SamplingConfig`` from either the object or its fields as keywords (both: an error)."""
    fields = SamplingConfig(do_sample, temperature, top_k, top_p)
    if sampling is None:
        return fields
    if fields != SamplingConfig():
        raise TypeError("give sampling=SamplingConfig(...) or do_sample/temperature/top_k/top_p, not both")
    return sampling


class CompiledModel:
    """A quantized model: call it like the original; inspect ``graph_module`` and ``report``."""

    def __init__(
        self,
        graph_module: GraphModule,
        recipe: Recipe,
        report: Report,
        backend: str,
        runner,
        example_inputs: tuple[tuple, dict],
    ):
        self.graph_module = graph_module
        self.recipe = recipe
        self.report = report
        self.backend = backend
        self.example_inputs = example_inputs
        self._runner = runner

    def _check_token_ids(self, ids: torch.Tensor) -> None:
        """Out-of-range ids would index the embedding silently wrong (-1 reads the last row)."""
        vocab = (self.capture_info.model_config or {}).get("vocab_size")
        if ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
        if ids.numel() == 0:
            raise ValueError(f"input_ids is empty (shape {tuple(ids.shape)}): give at least one token")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or (isinstance(vocab, int) and high >= vocab):
            bad = low if low < 0 else high
            raise ValueError(f"input_ids holds token id {bad}, outside the model's vocabulary [0, {vocab})")

    def materialize(self) -> "CompiledModel":
        """Read the tensors a ``compile(..., materialize=False)`` left on disk (nothing otherwise)."""
        lazy_weights.materialize_all(self.graph_module, progress_line)
        return self

    @property
    def capture_info(self) -> CaptureInfo:
        """What capture recorded about the model (class, call signature, config, cache layout)."""
        return self.graph_module.meta["qcompiler"]

    @property
    def cache_layout(self) -> Optional[CacheLayout]:
        """The KV cache's layout for a causal LM captured with its cache, else None."""
        cache = self.capture_info.cache
        return CacheLayout.from_dict(cache) if cache else None

    def __call__(self, *args, **kwargs) -> Any:
        """Call like the original model. A causal LM captured with its cache takes ``input_ids``,
        optional ``attention_mask`` / ``position_ids`` and ``past_key_values`` (the flat tuple a
        previous call returned) and returns ``.logits`` and ``.past_key_values``."""
        self.materialize()
        for name, value in self.capture_info.constant_kwargs.items():
            kwargs.setdefault(name, value)
        fill_optional_inputs(self.capture_info, kwargs)
        ids = kwargs.get("input_ids", args[0] if args and self.capture_info.model_config else None)
        if isinstance(ids, torch.Tensor):
            self._check_token_ids(ids)
        layout = self.cache_layout
        if layout is None and isinstance(kwargs.get("attention_mask"), torch.Tensor):  # graph_inputs checks the rest
            check_mask_values(kwargs["attention_mask"])
        try:
            with torch.no_grad():
                if layout is None:
                    return self._runner(*args, **kwargs)
                return wrap_output(self._runner(**self._cache_inputs(layout, args, kwargs)))
        except AssertionError as exc:  # torch.export's shape guards: say which limit, as one line
            guard = str(exc).strip()
            if not guard.startswith("Guard failed"):
                raise
            raise ValueError(
                f"these inputs break a shape limit of the captured {self.capture_info.model_class}: "
                f"{guard.removeprefix('Guard failed:').strip()} (a model with learned positions takes at most "
                "max_position_embeddings tokens)"
            ) from None

    def _cache_inputs(self, layout: CacheLayout, args: tuple, kwargs: dict) -> dict:
        kwargs = dict(kwargs)
        if args:
            kwargs.setdefault("input_ids", args[0])
            if len(args) > 1:
                raise ValueError("pass the model's inputs after input_ids by name (attention_mask=..., ...)")
        kwargs.pop("use_cache", None)
        unknown = set(kwargs) - {"input_ids", "attention_mask", "position_ids", "past_key_values"}
        if unknown:
            raise ValueError(
                f"{self.capture_info.model_class} takes input_ids, attention_mask, position_ids and "
                f"past_key_values; got also {sorted(unknown)}"
            )
        if "input_ids" not in kwargs:
            raise ValueError("input_ids is required")
        return graph_inputs(
            layout,
            kwargs["input_ids"],
            kwargs.get("attention_mask"),
            kwargs.get("position_ids"),
            kwargs.get("past_key_values"),
        )

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 32,
        *,
        sampling: Optional[SamplingConfig] = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id=None,
        pad_token_id: Optional[int] = None,
        attention_mask: Optional[torch.Tensor] = None,
        streamer: Optional[Callable[[torch.Tensor], None]] = None,
        seed: Optional[int] = None,
        cache: str = "auto",
    ) -> torch.Tensor:
        """Prompt plus up to ``max_new_tokens`` new tokens ``[B, S + T]``, decoding with the KV cache.

        Batches of prompts are left-padded (``attention_mask`` zeros on the left). ``streamer`` is
        called with each step's tokens ``[B]`` as they are made; :meth:`stream` yields them instead.
        ``cache``: ``"dynamic"`` feeds each step's grown cache back; ``"static"`` decodes over a
        preallocated one (:class:`qcompiler.frontend.static_cache.StaticCache`: fixed shapes, captured as a
        CUDA graph on a GPU); ``"auto"`` takes static on the triton backend's GPU, else dynamic.
        ``sampling``: a :class:`qcompiler.generation.SamplingConfig` (greedy by default), or its
        fields as the keywords ``do_sample``, ``temperature``, ``top_k``, ``top_p`` — not both.
        """
        self.materialize()
        tokens = []
        for token in self.stream(
            input_ids,
            max_new_tokens,
            sampling=_sampling(sampling, do_sample, temperature, top_k, top_p),
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            attention_mask=attention_mask,
            seed=seed,
            cache=cache,
        ):
            tokens.append(token[:, None])
            if streamer is not None:
                streamer(token)
        return torch.cat([input_ids, *tokens], 1)

    def stream(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 32,
        *,
        sampling: Optional[SamplingConfig] = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id=None,
        pad_token_id: Optional[int] = None,
        attention_mask: Optional[torch.Tensor] = None,
        seed: Optional[int] = None,
        cache: str = "auto",
    ) -> Iterator[torch.Tensor]:
        """Yield each step's new tokens ``[B]`` (see :meth:`generate`)."""
        self.materialize()
        layout = self.cache_layout
        if layout is None:
            raise ValueError(
                f"generate needs a causal LM captured with its KV cache; this graph of "
                f"{self.capture_info.model_class} has none (an encoder, or captured with use_cache=False)"
            )
        if isinstance(input_ids, torch.Tensor) and input_ids.numel():
            self._check_token_ids(input_ids)
        config = self.capture_info.model_config or {}
        if eos_token_id is None:
            eos_token_id = config.get("eos_token_id")
        sampling = _sampling(sampling, do_sample, temperature, top_k, top_p)

        def step(inputs):
            with torch.no_grad():
                return self._runner(**inputs)

        yield from generate_tokens(
            step,
            layout,
            config.get("vocab_size"),
            input_ids,
            max_new_tokens=max_new_tokens,
            attention_mask=attention_mask,
            sampling=sampling,
            eos_token_id=eos_token_id,
            pad_token_id=config.get("pad_token_id") if pad_token_id is None else pad_token_id,
            seed=seed,
            static_cache=self._static_cache(cache, config),
        )

    def _static_cache(self, cache: str, config: dict) -> Optional[Callable]:
        """``StaticCache`` maker for :meth:`stream` (it may answer None: the dynamic cache), or None."""
        from qcompiler.frontend.static_cache import StaticCache

        if cache not in ("auto", "dynamic", "static"):
            raise ValueError(f"cache must be 'auto', 'dynamic' or 'static', got {cache!r}")
        device = getattr(self._runner, "device", None)  # the triton backend's GPU runner has one
        on_gpu = isinstance(device, torch.device) and device.type == "cuda"
        if cache == "dynamic" or (cache == "auto" and not on_gpu):
            return None
        # a window only matters past its length (Qwen2 configs name one they do not use)
        window = int(config.get("sliding_window") or 0) if config.get("use_sliding_window", True) else 0
        run = getattr(self._runner, "runner", self._runner)  # the device graph itself: tensors stay there

        def make(batch: int, slots: int) -> Optional[StaticCache]:
            if window and slots >= window:  # the graph's window logic engages once past + 1 > window
                if cache == "auto":
                    return None
                raise ValueError(
                    f"{slots} positions reach this model's sliding window of {window}: use cache='dynamic'"
                )
            return StaticCache(
                run, self.cache_layout, batch, slots, device if on_gpu else torch.device("cpu"), cuda_graph=on_gpu
            )

        return make

    def with_backend(self, backend: str, **options) -> "CompiledModel":
        """The same quantized graph on another backend: no recapture, no calibration, weights shared."""
        self.materialize()
        report = Report([p for p in self.report.passes if not p.name.startswith("backend:")])
        return on_backend(self.graph_module, self.recipe, report, backend, self.example_inputs, options)

    def export(self, format: str, path, options=None, **settings):
        """Write this model in a registered export format (``qcompiler.export_formats``: onnx,
        onnx-genai, gptq, compressed-tensors, gguf, or one of yours) to ``path``, a file or a folder
        as the format writes: ``options`` an ``ExportOptions``, or its fields as keywords
        (``cm.export("gptq", "out/ckpt", zero_format="v2")``); a setting the format does not read
        is refused. Returns what the writer returns (the path written)."""
        fmt = export_format(format)
        if options is not None and settings:
            raise TypeError("give options or settings as keywords, not both")
        if options is None:
            fmt.check_settings(settings)
            options = ExportOptions(**settings)
        return fmt.write(self, Path(path), options)

    def export_onnx(self, path, *, accuracy_level: Optional[int] = None, fused_attention: bool = True, protect=()):
        """Write the graph as an ONNX model that ONNX Runtime runs (see docs/backends/onnx.md); an
        existing file is replaced only when it is an earlier qcompiler ONNX export."""
        self.materialize()
        from qcompiler.backends.onnx_export import export_onnx

        return export_onnx(
            self.graph_module,
            path,
            self.example_inputs,
            recipe=self.recipe.name,
            accuracy_level=accuracy_level,
            fused_attention=fused_attention,
            protect=protect,
        )

    def export_gguf(
        self,
        path,
        *,
        requantize: Optional[str] = None,
        token_embedding: Optional[str] = None,
        protect=(),
        progress=print,
    ):
        """Write one GGUF file that llama.cpp runs (docs/formats.md, "GGUF"); layers on GGUF's own grids
        (recipes ``gptq-q4_0``, ``gptq-q8_0``) are written code for code, others only with ``requantize``;
        ``token_embedding`` stores the FP embeddings as that block type instead of F16."""
        self.materialize()
        from qcompiler.interop.gguf_export import export_gguf

        return export_gguf(
            self, path, requantize=requantize, token_embedding=token_embedding, protect=protect, progress=progress
        )

    def save(
        self,
        path,
        *,
        metadata: Optional[dict] = None,
        overwrite: bool = False,
        protect=(),
        max_shard_bytes: int = artifact.DEFAULT_SHARD_BYTES,
    ):
        """Write the quantized model to folder ``path`` (atomic; reload with ``qc.load(path)``).

        An existing folder is replaced only if it is empty or an earlier artifact (another qcompiler
        output with ``overwrite``); a folder holding files qcompiler did not write, the model's own
        source folder and ``protect`` paths never are. Tensors past
        ``max_shard_bytes`` (5 GiB) go to several files."""
        return artifact.save(
            self, path, metadata=metadata, overwrite=overwrite, protect=protect, max_shard_bytes=max_shard_bytes
        )

    def __repr__(self) -> str:
        passes = ", ".join(repr(p) for p in self.recipe.passes) or "none"
        return (
            f"CompiledModel({self.capture_info.model_class}, recipe={self.recipe.name!r}, "
            f"backend={self.backend!r}, passes=[{passes}])"
        )


def on_backend(
    gm: GraphModule,
    recipe: Recipe,
    report: Report,
    backend: str,
    example_inputs: tuple[tuple, dict],
    options: Optional[dict] = None,
) -> CompiledModel:
    """Prepare ``backend`` for ``gm``; its plan (kernels, fallbacks), if it records one, joins ``report``.
    Shared by ``compile``, ``qc.load`` and ``with_backend``."""
    from qcompiler.backends import get_backend  # qcompiler.backends imports this module's package

    gm.meta["qcompiler_recipe"] = recipe.name  # what made this graph: exports record it (ONNX metadata)
    runner = get_backend(backend)(gm, example_inputs, **dict(options or {}))
    if getattr(runner, "record", None) is not None:
        report.passes.append(runner.record)
    return CompiledModel(gm, recipe, report, backend, runner, example_inputs)


def normalize_calibration(calibration: Optional[Iterable], info: CaptureInfo) -> Optional[list[tuple[tuple, dict]]]:
    """Calibration batches as ``(args, kwargs)``, with the capture's constant kwargs filled in."""
    if calibration is None:
        return None
    if isinstance(calibration, torch.Tensor):  # a stacked batch of token windows
        calibration = [calibration]
    batches = []
    layout = CacheLayout.from_dict(info.cache) if info.cache else None
    for item in calibration:
        args, kwargs = normalize_inputs(item)
        for name, value in info.constant_kwargs.items():
            kwargs.setdefault(name, value)
        fill_optional_inputs(info, kwargs)
        if layout is not None:  # the cache graph, run with an empty past
            kwargs.pop("use_cache", None)
            ids = kwargs.pop("input_ids", args[0] if args else None)
            kwargs, args = graph_inputs(layout, ids, kwargs.pop("attention_mask", None), **kwargs), ()
        batches.append((args, kwargs))
    if not batches:
        raise CalibrationError("the calibration set is empty: pass at least one batch of inputs")
    return batches


def load(path, backend: str = "eager", *, backend_options: Optional[dict] = None) -> CompiledModel:
    """A CompiledModel from a folder written by ``cm.save``; no calibration, no original model code."""
    stored = artifact.read(path)
    return on_backend(
        stored.graph_module, stored.recipe, stored.report, backend, stored.example_inputs, backend_options
    )


def refuse_non_finite(gm: torch.fx.GraphModule) -> None:
    """Every stored floating tensor of the result must be finite: a NaN norm weight passes a
    calibration-free recipe untouched, and W8A8 turned NaN weights into NaN scales that generate only
    padding. Non-persistent buffers (masks may hold -inf) are not the model's weights."""
    from qcompiler.algorithms.finite import all_finite
    from qcompiler.errors import QuantizationError
    from qcompiler.ir.tensors import get_tensor

    transient = set(getattr(gm.meta.get("qcompiler"), "transient", ()))
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target in transient:
            continue
        t = get_tensor(gm, node.target)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not all_finite(t):
            bad = int((~torch.isfinite(t)).sum())
            raise QuantizationError(
                f"{node.target}: {bad} of its {t.numel()} values are NaN or Inf; the checkpoint is "
                "damaged, or a pass produced them (nothing was written)"
            )


def resolve_device(device) -> Optional[torch.device]:
    """``"auto"``: the GPU when there is one, else where the weights are (None); a name must exist."""
    if device is None or isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device name (cpu, cuda, cuda:1, auto)") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r}: no CUDA GPU is available to this torch ({torch.__version__}); use device='cpu'"
        )
    return resolved


def compile(
    model: torch.nn.Module,
    example_inputs,
    recipe="none",
    calibration: Optional[Iterable] = None,
    backend: str = "eager",
    options: Optional[CompileOptions] = None,
    **settings,
) -> CompiledModel:
    """Capture ``model``, apply ``recipe``'s passes in order, and prepare ``backend`` to run it.

    ``recipe``: a built-in name (see ``qc.list_recipes()``), a ``qc.Recipe``, or a list of passes.
    ``calibration``: an iterable of inputs shaped like ``example_inputs`` (needed by data-driven passes).
    ``backend``: ``eager`` (reference ops), ``triton`` (GPU kernels; CPU only under TRITON_INTERPRET=1) or
    ``onnxruntime``. How it runs — ``device``, ``offload``, ``progress``, ``backend_options``,
    ``checkpoint`` / ``resume`` / ``keep_checkpoint``, ``materialize`` — is a
    :class:`qcompiler.compile_options.CompileOptions`, given as ``options=`` or as its fields by
    keyword (``compile(..., device="cpu", progress=False)``), not both.
    """
    from qcompiler.backends import get_backend  # qcompiler.backends imports this module's package

    o = compile_options(options, settings)
    resolved = resolve_recipe(recipe)
    get_backend(backend)  # an unknown backend fails before any work
    if not o.materialize and backend != "eager":
        raise ValueError(f"materialize=False leaves weights on disk; backend {backend!r} needs them: use 'eager'")
    compute = current_ranks().device(resolve_device(o.device))  # a rank of a distributed run: its own GPU
    manager = PassManager(resolved.passes)
    manager.validate(has_calibration=calibration is not None)
    log = progress_line if o.progress else (lambda _message: None)
    with heartbeat(log, f"capturing {type(model).__name__} with torch.export"):
        gm = capture(model, example_inputs)
    info: CaptureInfo = gm.meta["qcompiler"]
    examples = normalize_inputs(example_inputs)
    fill_optional_inputs(info, examples[1])  # the graph takes them; backends see them
    if info.cache:  # backends and exports see the graph's own inputs
        user = examples[1]
        examples = (
            (),
            example_graph_inputs(CacheLayout.from_dict(info.cache), user["input_ids"], user.get("attention_mask")),
        )
    ctx = PassContext(
        example_inputs=examples,
        calibration=normalize_calibration(calibration, info),
        progress=o.progress,
        device=compute,
        offload=o.offload,
    )
    if o.checkpoint is not None:
        ctx.checkpoint = RunCheckpoint(
            o.checkpoint,
            run_fingerprint(gm, resolved.passes, ctx.calibration),
            resume=o.resume,
            writer=current_ranks().is_root,
            log=ctx.log,
        )
    gm, report = manager.run(gm, ctx)
    if ctx.checkpoint is not None and not o.keep_checkpoint:
        ctx.checkpoint.remove()
    if o.materialize:
        lazy_weights.materialize_all(gm, ctx.log)  # streamed weights no pass replaced, parked results
    refuse_non_finite(gm)  # one tensor at a time: placeholders are read and dropped
    return on_backend(gm, resolved, report, backend, ctx.example_inputs, o.backend_options)
