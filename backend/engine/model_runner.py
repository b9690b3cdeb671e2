"""Owns the model and the KV cache tensors; turns a SchedulerOutput into one forward pass
over a flat batch and one sampled token per request that asked for it."""

from __future__ import annotations

import array
import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np
import torch

from backend.attention_metadata import AttentionMetadata
from backend.config import EngineConfig
from backend.engine.batch import (
    PLACEHOLDER,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from backend.engine.block_tables import DeviceBlockTables
from backend.engine.cuda_graphs import DecodeGraphs, Forward, GraphableBackend, can_capture
from backend.engine.draft import DraftModel
from backend.errors import RequestStepError
from backend.grammar import fill_bitmasks
from backend.layers import kv_quant
from backend.layers.attention import AttentionBackend, attention_backend
from backend.layers.lora import LoRALinear, add_lora_layers, rows_of
from backend.layers.quant import check_quantization, quantize
from backend.layers.rejection import greedy_verify, rejection_sample
from backend.layers.sampler import (
    SamplingTensors,
    apply_penalties_batch,
    apply_token_bitmask,
    assemble_logprobs,
    logprob_tensors,
    sample_tokens,
    sampling_probs,
)
from backend.layers.staging import Readback, Staging, to_device, to_host
from backend.loader import load_model, resolve_device, resolve_dtype
from backend.models.config import ModelConfig
from backend.outputs import TokenLogprobs
from backend.sampling import SamplingParams

_EMBED_PARAMS = SamplingParams(max_tokens=1)  # an embedding samples nothing
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        model_config: ModelConfig,
        config: EngineConfig,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.config = config
        self.eos_token_ids = eos_token_ids  # masked until a request reaches min_tokens
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r} requested but CUDA is not available")
        if self.device.type == "cpu":
            _keep_freed_memory()
            if config.cpu_threads is not None:
                torch.set_num_threads(config.cpu_threads)
        # Called before each layer of an eager forward pass of a step: raising there
        # abandons the step before it samples (Engine._give_way). What the step wrote is
        # never read as computed: its KV slots lie past its rows' computed tokens.
        self.between_layers: Callable[[], None] | None = None
        self.dtype = resolve_dtype(config.dtype, self.device, model_config)
        self.attention: AttentionBackend = attention_backend(config.attention_backend, self.device)
        check_quantization(config.quantization, self.device)  # before the load: fail fast
        kv_quant.check_kv_cache_dtype(config.kv_cache_dtype, self.device)
        # The KV cache's own dtype: the compute dtype, or one byte plus scales per value.
        self.kv_dtype = kv_quant.cache_dtype(config.kv_cache_dtype, self.dtype)
        self.model = load_model(
            model_dir,
            model_config,
            dtype=self.dtype,
            device=self.device,
            max_positions=max_model_len,
            backend=self.attention,
        )
        quantize(self.model, config.quantization)
        self.lora_layers: dict[str, LoRALinear] = {}  # backend/engine/lora.py fills their slots
        if config.max_loras:
            self.lora_layers = add_lora_layers(self.model, config.max_loras, config.max_lora_rank)
        self.drafter: DraftModel | None = None
        per_block = kv_bytes_per_block(model_config, config.block_size, self.kv_dtype)
        if config.speculative_method == "draft" and config.speculative_model:
            self.drafter = DraftModel(
                Path(config.speculative_model),
                model_config,
                dtype=self.dtype,
                device=self.device,
                max_positions=max_model_len,
                backend=self.attention,
                max_tokens=config.max_num_batched_tokens,
            )
            # Its pool mirrors the target's block for block: the budget holds both.
            per_block += kv_bytes_per_block(self.drafter.config, config.block_size, self.kv_dtype)
        self.num_blocks = config.num_kv_blocks or self._kv_budget(max_model_len) // per_block
        if self.drafter is not None:
            self.drafter.allocate(self.num_blocks, config.block_size, self.kv_dtype)
        # [layers][2 (K, V)][num_blocks, block_size, kv_heads, head_dim (+ scale bytes)]
        self.kv_cache = kv_quant.allocate(
            model_config, self.num_blocks, config.block_size, self.kv_dtype, self.device
        )
        self._generators: dict[str, torch.Generator] = {}
        self._prompt_masks: dict[str, torch.Tensor] = {}  # penalised requests' prompts
        self._biases: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # logit_bias as arrays
        # Live requests' block tables, on the device, written by difference each step.
        width = _aligned(-(-max_model_len // config.block_size))
        self.block_tables = DeviceBlockTables(width, self.device)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager and can_capture(self.attention):
            self._capture_graphs()
        self.use_cuda_graphs = self.graphs is not None  # may be switched off (benchmarks)

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """The target's decode graphs, and the draft model's for its draft steps (one
        token a row, the same block tables)."""
        self.graphs = self._decode_graphs(
            lambda ids, positions, meta: self.model(ids, positions, self.kv_cache, meta)
        )
        if self.drafter is not None:
            self.drafter.graphs = self._decode_graphs(self.drafter.forward)

    def _decode_graphs(self, forward: Forward) -> DecodeGraphs:
        graphs = DecodeGraphs(
            forward,
            cast(GraphableBackend, self.attention),
            max_num_seqs=self.config.seqs_limit,
            max_blocks=self.block_tables.width,
            block_size=self.config.block_size,
            device=self.device,
        )
        graphs.capture()
        return graphs

    @property
    def use_cuda_graphs(self) -> bool:
        return self._use_cuda_graphs

    @use_cuda_graphs.setter
    def use_cuda_graphs(self, on: bool) -> None:
        """Decode steps replay the captured graphs (the draft model's too) or run eagerly."""
        self._use_cuda_graphs = on
        if self.drafter is not None:
            self.drafter.use_graphs = on

    @property
    def graph_replays(self) -> int:
        return 0 if self.graphs is None else self.graphs.replays

    @property
    def draft_graph_replays(self) -> int:
        drafter = self.drafter
        return 0 if drafter is None or drafter.graphs is None else drafter.graphs.replays

    @property
    def attention_name(self) -> str:
        name: str = getattr(self.attention, "name", type(self.attention).__name__)
        return name

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """One step, start to finish: launch it, then wait for its tokens."""
        return self.launch(batch).collect()

    @torch.inference_mode()
    def launch(
        self,
        batch: SchedulerOutput,
        previous: Launched | None = None,
        land: Callable[[], object] | None = None,
    ) -> Launched:
        """Enqueue the step's forward pass and sampling on the device and return without
        waiting (on a GPU; the CPU computes as it goes). `previous`: the step launched
        before it and not yet collected, whose sampled tokens fill this step's
        PLACEHOLDER input ids on the device (async scheduling). `land`: called once the
        forward pass is enqueued and before the sampling inputs are staged, so the
        caller can read `previous` back there: a grammar's mask and the penalties over
        the output then see its tokens, while the device runs this step's forward
        pass."""
        if self.drafter is not None:
            self.drafter.forget(batch.finished_request_ids)
        for request_id in batch.finished_request_ids:
            self._generators.pop(request_id, None)
            self._prompt_masks.pop(request_id, None)
            self._biases.pop(request_id, None)
        self.block_tables.release(batch.finished_request_ids)
        if not batch.requests:
            return Launched.done(ModelRunnerOutput({}))
        reqs = [r for r in batch.requests if r.sample]
        generators = self._generators_for(reqs)  # first: a bad seed fails only its request
        draft_probs = None
        patch = _placeholder_patch(batch, previous, self.device)
        if self.drafter is not None:  # fills the rows' draft placeholders
            by_id = {r.request_id: g for r, g in zip(reqs, generators, strict=True)}
            draft_probs = self.drafter.propose(batch, self._prepare, by_id, self.block_tables)
        # One logits row per sampled position: a row with drafts samples at each of its
        # last num_drafts + 1 positions, with its parameters repeated.
        speculative = any(r.num_drafts for r in reqs)
        per_row = [r for r in reqs for _ in range(r.num_drafts + 1)] if speculative else reqs
        stage = Staging(self.device)  # sampling's inputs, copied with one transfer
        stage.add("last", _sampled_rows(batch))
        SamplingTensors.stage(stage, [r.params for r in per_row], self.model.cfg.vocab_size)
        if speculative:
            _stage_drafts(stage, reqs)
        hidden = self._forward(batch, patch)
        if land is not None:
            land()
        if not reqs:
            return Launched.done(ModelRunnerOutput({}))
        # Host work while a GPU runs the forward pass; after `land`, for the tokens.
        self._stage_logit_work(stage, per_row)
        _stage_grammar_masks(stage, per_row)
        staged = stage.upload()
        logits = self.model.logits(hidden[staged["last"]])
        if "grammar_rows" in staged:  # masked before logprobs: they describe what is sampled
            apply_token_bitmask(logits, staged["grammar_rows"], staged["grammar_masks"])
        processed = self._process_logits(logits, per_row, staged)
        sampling = SamplingTensors.of(staged, [r.params for r in per_row])
        if speculative:
            return Launched.done(
                self._verify(reqs, logits, processed, sampling, generators, staged, draft_probs)
            )
        tokens = sample_tokens(processed, generators, sampling)
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        k = max((reqs[i].params.logprobs or 0 for i in want), default=0)
        lps = logprob_tensors(logits, tokens, k) if want else ()
        return Launched(reqs, tokens, want, lps)

    def _verify(
        self,
        reqs: list[ScheduledRequest],
        logits: torch.Tensor,
        processed: torch.Tensor,
        sampling: SamplingTensors,
        generators: list[torch.Generator | None],
        staged: dict[str, torch.Tensor],
        draft_probs: torch.Tensor | None,
    ) -> ModelRunnerOutput:
        """A step with draft tokens: rows without drafts sample as usual; rows with drafts
        are verified by rejection sampling (backend/layers/rejection.py) against their
        proposal (the draft model's q, or one-hot for n-gram drafts). One read-back."""
        plain = [i for i, r in enumerate(reqs) if not r.num_drafts]
        spec = [i for i, r in enumerate(reqs) if r.num_drafts]
        spec_rows, drafts, num = staged["spec_rows"], staged["spec_drafts"], staged["spec_num"]
        if sampling.all_greedy:
            argmax = processed.argmax(dim=-1)
            results = [*greedy_verify(argmax[spec_rows], drafts, num)]
        else:
            flat = spec_rows.flatten()
            probs = sampling_probs(processed[flat], sampling.select(flat))
            gens = [generators[i] for i in spec]
            shaped = probs.view(*spec_rows.shape, -1)
            results = [*rejection_sample(shaped, drafts, num, draft_probs, gens)]
        want = [i for i in plain if reqs[i].params.logprobs is not None]
        if plain:
            rows = staged["plain_rows"]
            if sampling.all_greedy:
                tokens = argmax[rows]
            else:
                plain_gens = [generators[i] for i in plain]
                tokens = sample_tokens(processed[rows], plain_gens, sampling.select(rows))
            results.append(tokens)
            if want:
                k = max(reqs[i].params.logprobs or 0 for i in want)
                results += logprob_tensors(logits[rows], tokens, k)
        host = to_host(*results)
        verified = {}
        for i, n, token in zip(spec, host[0].tolist(), host[1].tolist(), strict=True):
            r = reqs[i]
            verified[r.request_id] = [*r.token_ids[len(r.token_ids) - r.num_drafts :][:n], token]
            if self.drafter is not None:
                self.drafter.verified(r.request_id, n)
        out = ModelRunnerOutput({}, verified=verified)
        if plain:
            sampled = dict(zip(plain, host[2].tolist(), strict=True))
            out.sampled.update({reqs[i].request_id: t for i, t in sampled.items()})
        if want:
            at = torch.tensor([plain.index(i) for i in want])
            found = assemble_logprobs(
                [sampled[i] for i in want],
                (host[3][at], host[4][at], host[5][at], host[6][at]),
                [reqs[i].params.logprobs or 0 for i in want],
            )
            out.logprobs.update({reqs[i].request_id: lp for i, lp in zip(want, found, strict=True)})
        return out

    @torch.inference_mode()
    def embed(self, prompts: list[list[int]], block_ids: list[list[int]]) -> list[list[float]]:
        """The mean of each prompt's final hidden states (after the final norm), its keys
        and values written to its `block_ids` (the caller's, enough for it): the step
        loop's own pass, without sampling. Several prompts go in one flat batch; a single
        one in chunks of max_num_batched_tokens."""
        chunk = self.config.max_num_batched_tokens
        if len(prompts) == 1:
            [ids], [blocks] = prompts, block_ids
            total = torch.zeros(self.model.cfg.hidden_size, dtype=torch.float32, device=self.device)
            for start in range(0, len(ids), chunk):
                hidden = self._embedding_pass([(ids, start, ids[start : start + chunk], blocks)])
                total += hidden.float().sum(dim=0)
            return [to_host(total / len(ids))[0].tolist()]
        hidden = self._embedding_pass(
            [(ids, 0, ids, blocks) for ids, blocks in zip(prompts, block_ids, strict=True)]
        )
        lengths = torch.tensor([len(ids) for ids in prompts], device=self.device)
        owner = torch.repeat_interleave(torch.arange(len(prompts), device=self.device), lengths)
        sums = torch.zeros(len(prompts), hidden.shape[1], device=self.device)
        sums.index_add_(0, owner, hidden.float())
        means: list[list[float]] = to_host(sums / lengths[:, None])[0].tolist()
        return means

    def _embedding_pass(
        self, pieces: list[tuple[list[int], int, list[int], list[int]]]
    ) -> torch.Tensor:
        """One forward pass over (prompt, start, tokens from start, blocks) pieces:
        the hidden states of every token given."""
        batch = SchedulerOutput(
            [
                ScheduledRequest(
                    request_id=str(i),
                    token_ids=tokens,
                    start_pos=start,
                    block_ids=blocks,
                    params=_EMBED_PARAMS,
                    sample=False,
                    prompt_token_ids=prompt,
                    output_token_ids=[],
                )
                for i, (prompt, start, tokens, blocks) in enumerate(pieces)
            ]
        )
        input_ids, positions, meta = self._prepare(batch, device_tables=False)
        hidden: torch.Tensor = self.model(input_ids, positions, self.kv_cache, meta)
        return hidden

    def _forward(self, batch: SchedulerOutput, patch: Patch | None = None) -> torch.Tensor:
        """Hidden states of every scheduled token: a CUDA-graph replay for decode-only
        steps that fit one, else the eager forward pass. `patch` rewrites the input ids
        on the device before either runs."""
        graphs, reqs = self.graphs, batch.requests
        if self.use_cuda_graphs and graphs is not None and graphs.takes(reqs):
            return graphs.replay_rows(reqs, self.block_tables, patch)
        input_ids, positions, meta = self._prepare(batch)
        if patch is not None:
            patch(input_ids)
        hidden: torch.Tensor = self.model(
            input_ids, positions, self.kv_cache, meta, self.between_layers
        )
        return hidden

    def _stage_logit_work(self, stage: Staging, reqs: list[ScheduledRequest]) -> None:
        """Penalties (rows, each row's output so far padded with -1, its three penalty
        values) and min_tokens masks (row, token pairs), for `_process_logits`."""
        penalized = [i for i, r in enumerate(reqs) if r.params.penalized]
        if penalized:
            longest = max(len(reqs[i].output_token_ids) for i in penalized)
            outputs = [reqs[i].output_token_ids for i in penalized]
            stage.add("pen_rows", penalized)
            stage.add("pen_outputs", [o + [-1] * (longest - len(o)) for o in outputs])
            stage.add("pen_values", [_penalties(reqs[i].params) for i in penalized], torch.float32)
        banned = [(i, t) for i, r in enumerate(reqs) for t in self._banned(r)]
        if banned:
            stage.add("ban_rows", [i for i, _ in banned])
            stage.add("ban_tokens", [t for _, t in banned])
        biased = [(i, self._bias_arrays(r)) for i, r in enumerate(reqs) if r.params.logit_bias]
        if biased:
            counts = [len(tokens) for _, (tokens, _) in biased]
            stage.add("bias_rows", np.repeat([i for i, _ in biased], counts))
            stage.add("bias_tokens", np.concatenate([tokens for _, (tokens, _) in biased]))
            values = np.concatenate([values for _, (_, values) in biased])
            stage.add("bias_values", values, torch.float32)

    def _bias_arrays(self, r: ScheduledRequest) -> tuple[np.ndarray, np.ndarray]:
        """A request's logit_bias as (token ids, values) arrays, built once: 300 entries
        on each of 256 rows would otherwise be 76,800 Python tuples every step."""
        arrays = self._biases.get(r.request_id)
        if arrays is None:
            bias = r.params.logit_bias
            tokens = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
            values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
            arrays = self._biases[r.request_id] = (tokens, values)
        return arrays

    def _process_logits(
        self,
        logits: torch.Tensor,
        reqs: list[ScheduledRequest],
        staged: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logit biases, penalties and min_tokens masks, on a copy: logprobs report the raw
        distribution.
        `staged`: what `_stage_logit_work` put on the device (built here if not given)."""
        if staged is None:
            stage = Staging(self.device)
            self._stage_logit_work(stage, reqs)
            staged = stage.upload()
        if not {"pen_rows", "ban_rows", "bias_rows"} & staged.keys():
            return logits
        out = logits.float().clone()
        if "bias_rows" in staged:  # first: the penalties then scale the biased logits
            rows, tokens = staged["bias_rows"], staged["bias_tokens"]
            out.index_put_((rows, tokens), staged["bias_values"], accumulate=True)
        if "pen_rows" in staged:
            penalized = [r for r in reqs if r.params.penalized]
            masks = torch.stack([self._prompt_mask(r, out.shape[-1]) for r in penalized])
            rows, outputs, values = staged["pen_rows"], staged["pen_outputs"], staged["pen_values"]
            apply_penalties_batch(out, rows, masks, outputs, values)
        if "ban_rows" in staged:
            out[staged["ban_rows"], staged["ban_tokens"]] = float("-inf")
        return out

    def _banned(self, r: ScheduledRequest) -> list[int]:
        """Tokens that may not end the output yet: below min_tokens, its stop tokens and
        (unless it ignores EOS) the model's EOS tokens."""
        p = r.params
        if len(r.output_token_ids) >= p.min_tokens:
            return []
        return [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]

    def _prompt_mask(self, r: ScheduledRequest, vocab: int) -> torch.Tensor:
        """A [vocab] mask of the prompt's tokens, built once per penalised request."""
        mask = self._prompt_masks.get(r.request_id)
        if mask is None:
            mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            mask[to_device(torch.tensor(r.prompt_token_ids), self.device)] = True
            self._prompt_masks[r.request_id] = mask
        return mask

    def _kv_budget(self, max_model_len: int) -> int:
        """On a GPU: what `gpu_memory_utilization` leaves once the weights are loaded and a
        step of max_num_batched_tokens has run (its activations and logits measured by a
        profiling pass), with the allocator's freed blocks returned first: kept, they
        counted as used (~16 GB of an 8B model's load on an H100)."""
        if self.device.type != "cuda":
            return self.config.kv_cache_bytes
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.profile_step(max_model_len)
        activations = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return gpu_kv_budget(total, free, self.config.gpu_memory_utilization, activations)

    @torch.inference_mode()
    def profile_step(self, max_model_len: int) -> None:
        """The largest step the engine schedules: max_num_batched_tokens prompt tokens (in
        sequences of at most the model's context) through the model over a scratch KV
        cache of just their blocks, then the logits of max_num_seqs rows. Everything it
        allocates is freed when it returns."""
        cfg, bs = self.config, self.config.block_size
        length = min(cfg.max_num_batched_tokens, max_model_len)
        count = -(-cfg.max_num_batched_tokens // length)
        per_seq = -(-length // bs)
        scratch = kv_quant.allocate(self.model.cfg, per_seq * count, bs, self.kv_dtype, self.device)
        ids = [1] * length
        pieces = [(ids, 0, ids, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(count)]
        kept, self.kv_cache = getattr(self, "kv_cache", None), scratch
        try:
            hidden = self._embedding_pass(pieces)
            self.model.logits(hidden[: cfg.seqs_limit])
        finally:
            if kept is not None:
                self.kv_cache = kept
            else:
                del self.kv_cache

    def _prepare(
        self, batch: SchedulerOutput, device_tables: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's inputs as one int64 buffer, copied to the device once and cut into
        views: input ids, positions, slots, sequence lengths, query starts, and the block
        tables' changed entries and rows (`device_tables`: a step's live requests) or the
        tables themselves (an embedding or profiling pass)."""
        bs = self.config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        for r in batch.requests:
            start, end = r.start_pos, r.start_pos + len(r.token_ids)
            input_ids += r.token_ids
            positions += range(start, end)
            if end - start == 1:  # a decode row: most rows, so no helper call
                slots.append(r.block_ids[start // bs] * bs + start % bs)
            else:
                slots += _slots(r.block_ids, start, end, bs)
            seq_lens.append(end)
            starts.append(starts[-1] + end - start)
        num_seqs = len(seq_lens)
        parts: tuple[list[int], ...]
        if device_tables:
            rows, changes = self.block_tables.plan(batch.requests)
            parts = (input_ids, positions, slots, seq_lens, starts, rows, changes)
        else:
            width = _aligned(max(len(r.block_ids) for r in batch.requests))
            tables: list[int] = []
            for r in batch.requests:
                tables += r.block_ids
                tables += [0] * (width - len(r.block_ids))
            parts = (input_ids, positions, slots, seq_lens, starts, tables)
        flat = _int64_tensor(_packed(parts))
        flat = flat.to(self.device, non_blocking=True)
        ids, pos, slot_mapping, lens, query_starts, *rest = _views(flat, parts)
        if device_tables:
            self.block_tables.apply(rest[1])
            table = self.block_tables.gather(rest[0])
        else:
            table = rest[0].view(num_seqs, width)
        if self.lora_layers:
            self._set_lora_rows(batch)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=table,
            seq_lens=seq_lens,
            query_start_loc=starts,
            block_size=bs,
            seq_lens_tensor=lens,
            query_start_tensor=query_starts,
        )
        return ids, pos, meta

    def _set_lora_rows(self, batch: SchedulerOutput) -> None:
        """Each token's adapter slot for the LoRA layers, or None when no row has one."""
        slots = None
        if any(r.lora_slot >= 0 for r in batch.requests):
            per_token = [s for r in batch.requests for s in [r.lora_slot] * len(r.token_ids)]
            slots = self._tensor(per_token)
        rows_of(self.lora_layers).set(slots)

    def _tensor(self, data: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.int64).to(self.device, non_blocking=True)

    def _generators_for(self, reqs: list[ScheduledRequest]) -> list[torch.Generator | None]:
        """Each sampling request's generator; raises RequestStepError naming the requests
        whose generator cannot be made, before any work is spent on the step."""
        generators: list[torch.Generator | None] = []
        bad: list[str] = []
        for r in reqs:
            try:
                generators.append(self._generator(r))
            except (RuntimeError, ValueError, OverflowError, TypeError):
                bad.append(r.request_id)
        if bad:
            raise RequestStepError(bad, "its seed cannot seed a generator")
        return generators

    def _generator(self, r: ScheduledRequest) -> torch.Generator | None:
        """A seeded request draws from its own generator, created on its first sample."""
        if r.params.seed is None:
            return None
        if r.request_id not in self._generators:
            gen = torch.Generator(self.device).manual_seed(r.params.seed)
            self._generators[r.request_id] = gen
        return self._generators[r.request_id]


Patch = Callable[[torch.Tensor], object]


class Launched:
    """A launched step: its sampled tokens (and logprob tensors) on the device, read
    back by `collect`, the step's one wait."""

    def __init__(
        self,
        reqs: list[ScheduledRequest],
        tokens: torch.Tensor | None,
        want: list[int],
        lps: tuple[torch.Tensor, ...] | list[torch.Tensor],
        result: ModelRunnerOutput | None = None,
    ) -> None:
        self.reqs, self.tokens, self.want = reqs, tokens, want
        self._result = result
        # Started now: under async scheduling the next step is enqueued behind it.
        self._readback = Readback(tokens, *lps) if tokens is not None else None
        # Each sampled request's row in `tokens`: where the next step finds its input.
        self.rows = {r.request_id: i for i, r in enumerate(reqs)} if tokens is not None else {}

    @staticmethod
    def done(result: ModelRunnerOutput) -> Launched:
        """A step whose tokens are already on the host (verification, no samples)."""
        return Launched([], None, [], (), result)

    def collect(self) -> ModelRunnerOutput:
        if self._result is not None:
            return self._result
        assert self._readback is not None
        reqs, want = self.reqs, self.want
        # Logprobs over every row (one kernel each), read back with the tokens: one wait.
        host_tokens, *lps = self._readback.wait()
        sampled = host_tokens.tolist()
        found: list[TokenLogprobs] = []
        if want:
            rows = torch.tensor(want)
            found = assemble_logprobs(
                [sampled[i] for i in want],
                (lps[0][rows], lps[1][rows], lps[2][rows], lps[3][rows]),
                [reqs[i].params.logprobs or 0 for i in want],
            )
        self._result = ModelRunnerOutput(
            {r.request_id: t for r, t in zip(reqs, sampled, strict=True)},
            {reqs[i].request_id: lp for i, lp in zip(want, found, strict=True)},
        )
        return self._result


def _placeholder_patch(
    batch: SchedulerOutput, previous: Launched | None, device: torch.device
) -> Patch | None:
    """What puts the previous step's sampled tokens in place of this step's
    placeholders (each a row's last input id), without a round trip through the host."""
    if previous is None or previous.tokens is None:
        return None
    dst: list[int] = []
    src: list[int] = []
    end = 0
    for r in batch.requests:
        end += len(r.token_ids)
        if r.token_ids[-1] == PLACEHOLDER:
            dst.append(end - 1)
            src.append(previous.rows[r.request_id])
    if not dst:
        return None
    index = to_device(_int64_tensor(dst + src), device)
    at, rows = index[: len(dst)], index[len(dst) :]
    tokens = previous.tokens
    return lambda ids: ids.index_copy_(0, at, tokens.index_select(0, rows).to(ids.dtype))


def _int64_tensor(values: list[int]) -> torch.Tensor:
    """A host tensor over a packed array: about 4x faster than torch.tensor(list)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def _slots(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions start..end-1, one range per block rather than per token."""
    slots: list[int] = []
    pos = start
    while pos < end:
        index = pos // block_size
        stop = min(end, (index + 1) * block_size)
        base = (block_ids[index] - index) * block_size  # slot = base + position
        slots += range(base + pos, base + stop)
        pos = stop
    return slots


def _stage_grammar_masks(stage: Staging, reqs: list[ScheduledRequest]) -> None:
    """The constrained rows and their token bitmasks; nothing when no row is constrained."""
    constrained = [(i, r.matcher) for i, r in enumerate(reqs) if r.matcher is not None]
    if constrained:
        stage.add("grammar_rows", [i for i, _ in constrained])
        stage.add("grammar_masks", fill_bitmasks([m for _, m in constrained]), torch.int32)


def _sampled_rows(batch: SchedulerOutput) -> list[int]:
    """The flat-batch rows whose logits are sampled: each sampling request's last token,
    and before it the positions of its draft tokens' predecessors, if it has drafts."""
    rows: list[int] = []
    end = 0
    for r in batch.requests:
        end += len(r.token_ids)
        if r.sample:
            rows += range(end - 1 - r.num_drafts, end)
    return rows


def _stage_drafts(stage: Staging, reqs: list[ScheduledRequest]) -> None:
    """For `ModelRunner._verify`: each row with drafts as K + 1 rows of the step's logits
    (short rows repeat their last), its drafts padded to K, and how many it has; the
    logits rows of the requests without drafts."""
    k = max(r.num_drafts for r in reqs)
    spec_rows, drafts, plain_rows = [], [], []
    row = 0
    for r in reqs:
        n = r.num_drafts
        if n:
            spec_rows.append([row + min(j, n) for j in range(k + 1)])
            drafts.append(r.token_ids[len(r.token_ids) - n :] + [0] * (k - n))
        else:
            plain_rows.append(row)
        row += n + 1
    stage.add("spec_rows", spec_rows)
    stage.add("spec_drafts", drafts)
    stage.add("spec_num", [r.num_drafts for r in reqs if r.num_drafts])
    stage.add("plain_rows", plain_rows)


def _penalties(p: SamplingParams) -> list[float]:
    return [p.repetition_penalty, p.presence_penalty, p.frequency_penalty]


def _keep_freed_memory() -> None:
    """glibc hands large freed blocks back to the OS (mmap, heap trimming), so each step's
    activations land on fresh pages whose first-touch faults cost more than the math of a
    small model on CPU (several times over in a VM). Keep freed memory in the heap for
    reuse instead: blocks up to 32 MiB (glibc's maximum) come from the heap, and it is
    trimmed only past 1 GiB of free space. Process-wide; a no-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
    libc.mallopt(_M_TRIM_THRESHOLD, 2**30)


# Each part of a step's packed int64 buffer starts at a multiple of ALIGN elements (128
# bytes), and the block-table width is one: a kernel's pointer and stride arguments then
# keep their alignment class from step to step (no Triton recompile mid-run).
ALIGN = 16


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _packed(parts: tuple[list[int], ...]) -> list[int]:
    """The parts one after another, each padded with zeros to a multiple of ALIGN."""
    packed: list[int] = []
    for part in parts:
        packed += part
        packed += [0] * (_aligned(len(part)) - len(part))
    return packed


def _views(flat: torch.Tensor, parts: tuple[list[int], ...]) -> list[torch.Tensor]:
    views, offset = [], 0
    for part in parts:
        views.append(flat[offset : offset + len(part)])
        offset += _aligned(len(part))
    return views


def gpu_kv_budget(total: int, free: int, utilization: float, activations: int = 0) -> int:
    """KV bytes on a GPU, measured once the weights are loaded: the engine may use
    `utilization` of the device's memory, less what is already in use (weights, the CUDA
    context, other processes) and the peak `activations` of its largest step."""
    return max(int(total * utilization) - (total - free) - activations, 0)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """block_size x 2 (K and V) x layers x kv_heads x head_dim x bytes per element, a
    one-byte (int8, fp8) cache's scale bytes included (backend/layers/kv_quant.py)."""
    return block_size * kv_quant.kv_bytes_per_token(cfg, dtype)
