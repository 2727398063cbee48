"""model family -> builder (`config.ARCH_ALIASES` maps model_type names onto these)."""
from __future__ import annotations

from ..errors import ModelFormatError
from ..io.weights import WeightSource
from ..quant import QWeight
from . import falcon, llama, opt
from .base import CausalLM, TensorShapes

BUILDERS = {"llama": llama.build, "falcon": falcon.build, "opt": opt.build}
EMBEDDINGS = {"llama": llama.EMBED, "falcon": falcon.EMBED, "opt": opt.EMBED}
FUSED = {"llama": llama.fused_groups}  # families whose builder fuses weights read from separate tensors
SHAPES = {"llama": llama.tensor_shapes, "falcon": falcon.tensor_shapes, "opt": opt.tensor_shapes}


def tensor_shapes(src: WeightSource) -> TensorShapes:
    """(name, shape, required) of every tensor the model of `src` reads (its family's table)."""
    return SHAPES[src.config.family](src.config, src.has)


def check_shapes(src: WeightSource) -> None:
    """Every tensor the model reads is present (where required), readable, and has the shape
    the config implies, before anything is loaded: a one-element norm or bias, a q/k/v of the
    wrong width, a vocabulary that is not the embedding's is a clear error here instead of
    garbage or a crash later (the C decode steps read norm and bias vectors by the config's
    sizes)."""
    for name, shape, required in tensor_shapes(src):
        if not src.has(name):
            if required:
                raise ModelFormatError(
                    f"{src.path}: tensor {src.file_name(name)} is missing (needed for {name}); "
                    f"the file is incomplete or not a {src.config.model_type} model")
            continue
        got = src.shape(name)
        if got != shape:
            raise ModelFormatError(
                f"{src.path}: {src.file_name(name)} has shape {got}, the config needs {shape}: "
                "the file is damaged or not a supported model")
        src.check_readable(name)


def build_model(src: WeightSource, checked: bool = False) -> CausalLM:
    """The model of `src`; `checked`: the caller ran `check_shapes` already."""
    if not checked:
        check_shapes(src)
    prefetch(src)  # GGUF: matrices converted on worker threads while the builder runs
    try:
        model = BUILDERS[src.config.family](src)
    finally:
        src.end_prefetch()
    interleave_head(model)
    return model


def head_name(src: WeightSource) -> str:
    """The tensor the output projection reads: lm_head, or the embedding when they are tied."""
    return "lm_head.weight" if src.has("lm_head.weight") else EMBEDDINGS[src.config.family]


def prefetch(src: WeightSource) -> None:
    """Start converting the model's matrices ahead of the builder (`WeightSource.prefetch`),
    straight into the row layout the kernels read where it pays: the output head (the largest
    matrix: converting it first and copying it after would hold it twice) and the groups the
    builder fuses (q/k/v, gate/up: one buffer each, which `fuse_weights` then takes as it is)."""
    from ..kernels import cpu

    def records(part: QWeight, rows: int) -> QWeight | None:
        return cpu.empty_records_like(part, rows) if cpu.interleave_pays(part) else None

    groups = [[head_name(src)]] + FUSED.get(src.config.family, lambda c: [])(src.config)
    src.prefetch(groups=[(g, records) for g in groups])


def interleave_head(model: CausalLM) -> None:
    """The output projection with each row's scales next to its values (`interleave_rows`),
    shared with the embedding when the two are tied; a head kept as Q4_K (`q4k`) becomes its
    q4 repack first.  It is the largest single read of a
    decode step (Qwen2.5-1.5B: a 200 MB q6 matrix, over half the bytes per token at density
    0.1), so sparse decode gains from reading it as whole rows (`interleave_pays` says where)."""
    from ..kernels import cpu

    w = model.head.weight
    if isinstance(w, QWeight) and w.fmt == "q4k" and w.qs.is_cpu and w.qs.is_contiguous():
        # Q4_K kept as stored pays in row tiles only, which the head (whose rows the preview
        # reads) does not take: its q4 repack, as the loader makes it otherwise
        from ..io.gguf import q4k_to_q4

        new = q4k_to_q4(w)
        if model.embed.weight is w:
            model.embed.weight = new
        model.head.weight = w = new
    if not isinstance(w, QWeight) or not cpu.interleave_pays(w) or cpu.is_interleaved(w):
        return
    new = cpu.interleave_rows(w)
    if model.embed.weight is w:
        model.embed.weight = new
    model.head.weight = new


def tile_weights(model: CausalLM) -> int:
    """Hold the q4 and q6 weights that are only ever read whole (attention's q/k/v and o, a dense
    MLP's gate/up and down) as row tiles (tq4, tq6) where `cpu.tiles_pay` says so: the same bytes, read by
    kernels with less work per weight.  Fused groups (q/k/v, gate/up) become one tiled weight
    with the parts as views of it, when every part is a whole number of 16-row tiles.  Modules
    that read rows keep theirs: sparse FFNs, the embedding, and the output head (the head
    preview computes exact rows of it).  Returns how many weights were converted."""
    from ..kernels import cpu
    from ..quant import TILE_ROWS
    from .layers import MLP, Attention, Linear

    done = 0

    def group(mod, fused, names) -> None:
        nonlocal done
        lins = [getattr(mod, n) for n in names]
        if fused is None or not mod._intact() or not cpu.tiles_pay(fused.weight) \
                or any(lin.weight.rows % TILE_ROWS for lin in lins):
            for lin in lins:
                single(lin)
            return
        t = cpu.tile(fused.weight)
        fused.weight, views, a = t, [], 0
        for lin in lins:
            b = a + lin.weight.rows // TILE_ROWS
            lin.weight = QWeight(t.fmt, lin.weight.rows, lin.weight.cols, t.qs[a:b])
            views.append(lin.weight)
            a = b
        mod._parts = tuple(views)
        done += 1

    def single(lin) -> None:
        nonlocal done
        if isinstance(lin, Linear) and cpu.tiles_pay(lin.weight):
            lin.weight = cpu.tile(lin.weight)
            done += 1

    for m in list(model.modules()):
        if type(m) is Attention:
            group(m, m._qkv, ("q", "k", "v"))
            single(m.o)
        elif type(m) is MLP:
            if m.gate is None:
                single(m.up)
            else:
                group(m, m._gate_up, ("gate", "up"))
            single(m.down)
    return done
