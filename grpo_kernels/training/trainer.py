"""A thin GRPO trainer over ``GRPOLoss``: the loop, readable in one sitting.

Each step: take prompts; sample G completions per prompt with the policy; score them with
the reward functions; group advantages; old (mu > 1) and reference (beta > 0) log-probs
with the package's no-grad kernel; mu updates with ``GRPOLoss``, gradient clipping and an
optimizer step. Data parallel under ``torchrun`` (gloo on CPU, nccl on GPU): every rank
samples its share of the prompts, gradients are averaged, and the token-count normalizers
are summed across ranks so that N processes make the update one process would make on
the whole batch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import os
import random
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Sequence

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .. import __version__, collectives
from ..advantages import group_advantages, process_advantages
from ..distillation import reverse_kl_distillation_loss, topk_distillation_loss
from ..entropy_control import AdaptiveEntropy
from ..heads import fused_head, head_weights
from ..kept_set import KeptSet
from ..loss import FusedLinearGRPOLoss, GRPOLoss, token_logprobs
from ..objective import GRPOLossOutput
from ..wrapped import inside_forward
from . import progress_bar
from .checkpoint import (
    CHECKPOINT_FORMAT,
    REFERENCE_DIR,
    read_trainer_state,
    resume_differences,
    save_atomically,
    save_pretrained,
    tensor_bytes,
    write_manifest,
)
from .config import RECIPE, TrainerConfig
from .process_labels import labels_to_step_rewards
from .rollout import KeptSetRecorder, Rollout, StepBatch, left_padded_positions, reward_columns

RewardFunction = Callable[..., list[float | None]]
# what a user of the trainer imports from here (its settings and recipe live in ``config``)
__all__ = ["RECIPE", "GRPOTrainer", "Preempted", "RewardFunction", "Rollout", "TrainerConfig", "stop_requests"]


class Preempted(Exception):
    """The run was asked to stop (SIGTERM: a scheduler's notice; SIGINT: Ctrl-C) and stopped at the end of the
    step it was in, its checkpoint written at that step. ``exit_code``: 128 + the signal, as a shell reports it."""

    def __init__(self, signum: int, step: int, checkpoint: str):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name} at step {step}: checkpoint {checkpoint} written; "
            "--resume continues the run exactly"
        )


@contextlib.contextmanager
def stop_requests(signals=(signal.SIGTERM, signal.SIGINT)):
    """A list that SIGTERM and SIGINT append their number to while inside (the previous handlers come back after):
    the loop stops at the next step boundary. A second signal while stopping abandons the run at once
    (KeyboardInterrupt, no checkpoint). Outside the main thread (where Python takes no handler) the list stays
    empty."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handle(signum, frame):
        received.append(signum)
        if len(received) > 1:
            raise KeyboardInterrupt(f"a second {signal.Signals(signum).name} while stopping: abandoned")

    previous = {s: signal.signal(s, handle) for s in signals}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _keys_and_values_only(cache) -> bool:
    """Whether a transformers cache holds attention keys and values only, which repeating along the batch
    repeats as a prefix. transformers 5's caches of hybrid models (Falcon-H1's, Inkling's linear-attention and
    state-space layers) do not: a generate continued from them repeated fails. Caches without layers (transformers
    4) are taken as they are."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return True
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers)


def trainer_loss_options(config: TrainerConfig) -> dict:
    """The loss options a trainer of ``config`` builds its loss with (``GRPOTrainer``; the CLI checks them before any
    work)."""
    return dict(
        loss_type=config.loss_type,
        aggregation=config.aggregation,
        beta=config.beta,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high,
        temperature=config.temperature,
        max_completion_length=config.max_new_tokens,
        entropy_coef=config.entropy_coef,
    )


class GRPOTrainer:
    """GRPO on a Hugging Face causal LM with rule or model rewards.

    ``train_rows`` / ``eval_rows``: dicts with a "prompt" and any columns the reward
    functions read (passed to them as keyword lists, as TRL does). ``eval_reward`` scores
    a greedy completion for the held-out accuracy (default: the first reward function). ``format_reward``
    (optional) says whether a completion is well-formed: the malformed shares are logged beside the accuracy.
    """

    def __init__(
        self,
        model,
        tokenizer,
        reward_funcs: Sequence[RewardFunction],
        train_rows: list[dict],
        config: TrainerConfig,
        *,
        reward_weights: Sequence[float] | None = None,
        eval_rows: list[dict] | None = None,
        eval_reward: RewardFunction | None = None,
        device: str = "cpu",
        log: Callable[[dict], None] | None = None,
        format_reward: RewardFunction | None = None,
        teacher=None,
    ):
        if not reward_funcs:
            raise ValueError("reward_funcs must hold at least one reward function, got none")
        if (teacher is None) != (config.distillation == "none"):
            raise ValueError(
                f"distillation={config.distillation!r} needs a teacher model (teacher=), and a teacher needs a "
                f"distillation ('topk' or 'reverse_kl'); got teacher={'a model' if teacher is not None else None}"
            )
        if teacher is not None and config.fused_lm_head:
            raise ValueError("distillation runs on the logits path: fused_lm_head=True with a teacher is not served")
        if teacher is not None and config.adaptive_entropy and not config.distillation_with_reward:
            raise ValueError(
                "adaptive_entropy acts on the GRPO loss's entropy bonus: a distillation alone has none (set "
                "distillation_with_reward=True, or leave adaptive_entropy off)"
            )
        rank, size = collectives.world()
        if config.prompts_per_step % size:
            raise ValueError(f"prompts_per_step={config.prompts_per_step} must divide evenly over {size} processes")
        self.model, self.tokenizer, self.config, self.device = model.to(device), tokenizer, config, device
        self.reward_funcs, self.reward_weights = list(reward_funcs), reward_weights
        self.train_rows, self.eval_rows = train_rows, eval_rows or []
        self.eval_reward = eval_reward or reward_funcs[0]
        # a completion's well-formedness (1 / 0): the malformed share of the sampled answers (where it is one of
        # the reward functions) and of the held-out greedy ones is logged beside the accuracy
        self.format_reward = format_reward
        self._format_column = next((k for k, f in enumerate(self.reward_funcs) if f is format_reward), None)
        self.last_eval_malformed = float("nan")
        # the teacher of on-policy distillation: frozen, scoring the student's own samples
        self.teacher = None if teacher is None else teacher.to(device).eval().requires_grad_(False)
        self.ref_model = None
        if config.beta > 0:  # a frozen copy of the starting policy (a resumed run loads the run's own: load_state)
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self._reference_saved = False  # written with this run's first checkpoint
        loss_options = trainer_loss_options(config)
        self.entropy_control = (
            AdaptiveEntropy(
                coef=config.entropy_coef,
                target=config.entropy_target,
                coef_min=config.entropy_coef_min,
                coef_max=config.entropy_coef_max,
                delta=config.entropy_coef_delta,
            )
            if config.adaptive_entropy
            else None
        )
        # from logits, the loss takes the model's [B, T + 1, V] output whole (see _logits)
        # the fused lm_head applies the model's head transform, checked once on a probe of its forward
        # (grpo_kernels.heads.fused_head: a FusedHeadError names a model it cannot reproduce)
        self.head_transform = fused_head(model) if config.fused_lm_head else None
        self.loss_fn = (
            FusedLinearGRPOLoss(**loss_options, **self.head_transform.options)
            if config.fused_lm_head
            else GRPOLoss(drop_last_position=True, **loss_options)
        )
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
        self.step = 0
        self._nonfinite_in_a_row = 0  # steps in a row whose optimizer step a non-finite loss or norm skipped
        self.rng = random.Random(config.seed * 1000 + rank)
        self.log = log or (lambda record: None)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)

    # ----- generation and scoring -------------------------------------------------------
    def _encode_prompts(self, prompts: list[str]):
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        width = enc.input_ids.shape[1]
        if self.max_positions is not None and width + self.config.max_new_tokens > self.max_positions:
            raise ValueError(
                f"a prompt of {width} tokens plus max_new_tokens={self.config.max_new_tokens} exceeds the model's "
                f"context of {self.max_positions} positions"
            )
        return enc.input_ids.to(self.device), enc.attention_mask.to(self.device)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        *,
        greedy: bool = False,
        samples_per_prompt: int = 1,
        recorder: KeptSetRecorder | None = None,
    ):
        """Prompt ids and mask [B, P] and completion ids and mask [B, T] (1 up to and including the first
        EOS), B = len(prompts) x samples_per_prompt, each prompt's samples consecutive; sampled at the config's
        temperature, top-k and top-p, each step's kept set recorded by ``recorder`` where given.

        With several samples a prompt, its prefill runs once: the cache of all but its last token is
        computed for the distinct prompts and repeated for the samples, and ``generate`` continues from
        it (the same distribution; the prefill is most of the work when completions are short)."""
        prompt_ids, prompt_mask = self._encode_prompts(prompts)
        self.model.eval()
        sampling = dict(do_sample=False)
        if not greedy:  # the warpers are ours, so that the recorder runs after them (generate adds none itself)
            config = self.config
            chain = [TemperatureLogitsWarper(config.temperature)]
            chain += [TopKLogitsWarper(config.top_k)] if config.top_k > 0 else []
            chain += [TopPLogitsWarper(config.top_p)] if config.top_p < 1.0 else []
            chain += [recorder] if recorder is not None else []  # it sees the scores the sampler draws from
            sampling = dict(
                do_sample=True, temperature=1.0, top_k=0, top_p=1.0, logits_processor=LogitsProcessorList(chain)
            )
        sampling.update(self._shared_prefill(prompt_ids, prompt_mask, samples_per_prompt))
        prompt_ids = prompt_ids.repeat_interleave(samples_per_prompt, 0)
        prompt_mask = prompt_mask.repeat_interleave(samples_per_prompt, 0)
        out = self.model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            max_new_tokens=self.config.max_new_tokens,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            **sampling,
        )
        completion_ids = out[:, prompt_ids.shape[1] :]
        is_eos = completion_ids == self.tokenizer.eos_token_id
        first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1), completion_ids.shape[1])
        positions = torch.arange(completion_ids.shape[1], device=self.device)
        completion_mask = (positions.unsqueeze(0) <= first_eos.unsqueeze(1)).long()
        completion_ids = torch.where(completion_mask.bool(), completion_ids, self.tokenizer.pad_token_id)
        return prompt_ids, prompt_mask, completion_ids, completion_mask

    def _shared_prefill(self, prompt_ids, prompt_mask, samples: int) -> dict:
        """``generate``'s keyword for a cache of the prompts but their last token, repeated ``samples``
        times; none where there is nothing to share or the model's cache cannot be repeated."""
        # transformers 5 names the argument "cache", earlier versions "past_key_values"
        forward_params = inspect.signature(type(self.model).forward).parameters
        name = "cache" if "cache" in forward_params else "past_key_values"
        if samples == 1 or prompt_ids.shape[1] < 2 or name not in forward_params:
            return {}
        prefix_mask = prompt_mask[:, :-1]
        prefix = self.model(
            input_ids=prompt_ids[:, :-1],
            attention_mask=prefix_mask,
            position_ids=left_padded_positions(prefix_mask),
            use_cache=True,
            logits_to_keep=1,
        )
        cache = prefix[name] if name in prefix else None
        if not hasattr(cache, "batch_repeat_interleave") or not _keys_and_values_only(cache):
            return {}
        cache.batch_repeat_interleave(samples)
        return {name: cache}

    def score(self, rows: list[dict], completions: list[str]) -> torch.Tensor:
        """Rewards [B, K]: one column per reward function, NaN where it returned None."""
        columns = reward_columns(rows)
        prompts = [row["prompt"] for row in rows]
        scores = []
        for func in self.reward_funcs:
            name = getattr(func, "__name__", repr(func))
            try:
                values = func(prompts, completions, **columns)
            except Exception as err:
                raise RuntimeError(f"reward function {name} raised {type(err).__name__}: {err}") from err
            if values is None or len(values) != len(completions):
                got = "None" if values is None else f"{len(values)} scores"
                raise ValueError(
                    f"reward function {name} must return one score per completion ({len(completions)}), got {got}"
                )
            column = [float("nan") if v is None else float(v) for v in values]
            infinite = [i for i, v in enumerate(column) if math.isinf(v)]
            if infinite and self.config.nonfinite_rewards == "refuse":
                i = infinite[0]
                raise ValueError(
                    f"reward function {name} returned {column[i]} for completion {i} ({completions[i][:80]!r}) of "
                    f"prompt {prompts[i][:80]!r}: a reward must be finite (None or NaN: not applicable); with "
                    "nonfinite_rewards='drop_group' (--nonfinite-rewards drop_group) such a group is dropped instead"
                )
            if infinite:
                warnings.warn(
                    f"reward function {name} returned a non-finite reward for {len(infinite)} completion(s) (the "
                    f"first: {completions[infinite[0]][:80]!r}): their groups get no advantage this step",
                    stacklevel=2,
                )
            scores.append(column)
        return torch.tensor(scores, dtype=torch.float32).T

    # ----- the update ------------------------------------------------------------------
    def _completion_outputs(self, module, prompt_ids, prompt_mask, completion_ids, completion_mask, **kwargs):
        """``module`` run on prompt + completion (bf16 autocast on CUDA); its output and the prompt width."""
        attention_mask = torch.cat([prompt_mask, completion_mask], 1)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=str(self.device).startswith("cuda")):
            out = module(
                input_ids=torch.cat([prompt_ids, completion_ids], 1),
                attention_mask=attention_mask,
                position_ids=left_padded_positions(attention_mask),
                **kwargs,
            )
        return out, prompt_ids.shape[1]

    def _logits(self, model, *inputs):
        """Logits [B, T + 1, V]: the T positions that predict the completion tokens, then the last one,
        which the loss and token_logprobs drop without a copy (``drop_last_position``); the model
        computes only these (``logits_to_keep``)."""
        T = inputs[2].shape[1]
        out, _ = self._completion_outputs(model, *inputs, logits_to_keep=T + 1)
        return out.logits if out.logits.shape[1] == T + 1 else out.logits[:, -(T + 1) :]

    def sample_groups(self) -> Rollout:
        """Sample this rank's share of ``prompts_per_step`` prompts, G completions each, score them,
        group advantages (outcome advantages: process labels come after any filtering)."""
        config, (_, size) = self.config, collectives.world()
        rows = [self.rng.choice(self.train_rows) for _ in range(config.prompts_per_step // size)]
        grouped = [row for row in rows for _ in range(config.group_size)]
        truncated = config.top_k > 0 or config.top_p < 1.0
        recorder = KeptSetRecorder() if truncated else None
        prompt_ids, prompt_mask, completion_ids, completion_mask = self.generate(
            [r["prompt"] for r in rows], samples_per_prompt=config.group_size, recorder=recorder
        )
        kept_ids, sampler_logps = recorder.replay(completion_ids, completion_mask) if truncated else (None, None)
        completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        rewards = self.score(grouped, completions)
        # a group with an infinite reward (nonfinite_rewards="drop_group") takes no part: its rewards read as not
        # applicable, its advantages 0 and it counts as a group without signal (dynamic sampling drops it)
        dropped = torch.isinf(rewards).any(-1).view(-1, config.group_size).any(-1)
        if dropped.any():
            rewards = torch.where(dropped.repeat_interleave(config.group_size)[:, None], float("nan"), rewards)
        adv = group_advantages(rewards, config.group_size, weights=self.reward_weights)
        advantages = torch.where(
            dropped.repeat_interleave(config.group_size).to(adv.advantages.device), 0.0, adv.advantages
        )
        return Rollout(
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            advantages.to(self.device),
            rewards,
            (adv.zero_std_groups.cpu() | dropped),
            grouped,
            kept_ids,
            sampler_logps,
        )

    def rollout(self) -> Rollout:
        """The groups this step trains on (``sample_step().update``)."""
        return self.sample_step().update

    def sample_step(self) -> StepBatch:
        """This step's groups. With ``dynamic_sampling``, batches of prompts are sampled until this
        rank's share of ``prompts_per_step`` groups with unequal rewards is kept on every rank, or
        ``max_sampling_rounds`` batches were sampled (then the update takes the groups kept so far;
        if a rank kept none, its first group, whose zero advantages add nothing). With process
        supervision the step labels are computed for the kept groups only."""
        config = self.config
        sampled = [self.sample_groups()]
        update = sampled[0]
        if config.dynamic_sampling:
            wanted = sampled[0].zero_std.shape[0]
            kept = [sampled[0].groups(~sampled[0].zero_std)]
            count = lambda: sum(k.zero_std.shape[0] for k in kept)  # noqa: E731
            while len(sampled) < config.max_sampling_rounds and collectives.smallest(count()) < wanted:
                sampled.append(self.sample_groups())
                kept.append(sampled[-1].groups(~sampled[-1].zero_std))
            update = Rollout.concat(kept, self.tokenizer.pad_token_id) if count() else sampled[0]
            if count() > wanted:
                update = update.groups(torch.arange(update.zero_std.shape[0]) < wanted)
            elif not count():
                update = update.groups(torch.arange(wanted) < 1)
        if config.process_rollouts > 0:
            step_rewards, step_end = self.step_labels(update.rows, update.completion_ids, update.completion_mask)
            update.advantages = process_advantages(step_rewards, step_end, update.completion_mask, config.group_size)
        return StepBatch(update, Rollout.concat(sampled, self.tokenizer.pad_token_id))

    @torch.no_grad()
    def step_labels(self, grouped: list[dict], completion_ids: torch.Tensor, completion_mask: torch.Tensor):
        """MATH-SHEPHERD soft labels for every token-step: sample completions from each prefix, verify them.

        A label is a function of the prefix alone (and its dataset row), so completions of one row that share a
        prefix share its label: each distinct prefix is completed N times, once (a group's G completions share
        most of theirs: on the built-in task 13 % of a step's unfinished prefixes are distinct, so the labels cost
        an eighth of the generations one set a completion-step would). A
        prefix that already ends the completion (its last token is EOS) is judged as it is. The prefix is given to
        ``generate`` as text (re-tokenized), which is exact for the built-in character tokenizer. Returns
        ``(step_rewards [B, T], step_end [B, T])``.
        """
        verifier = self.eval_reward
        N, B = self.config.process_rollouts, completion_ids.shape[0]
        lengths = completion_mask.sum(1).tolist()
        eos = self.tokenizer.eos_token_id
        steps_of: dict[tuple, list[tuple]] = {}  # (row's id, prefix text, ends with EOS) -> its (completion, step)s
        for b in range(B):
            for j in range(lengths[b]):
                text = self.tokenizer.decode(completion_ids[b, : j + 1], skip_special_tokens=True)
                finished = int(completion_ids[b, j]) == eos
                steps_of.setdefault((id(grouped[b]), text, finished), []).append((b, j))
        labels = [[float("nan")] * lengths[b] for b in range(B)]
        row_of = lambda key: grouped[steps_of[key][0][0]]  # noqa: E731
        finished = [key for key in steps_of if key[2]]
        open_prefixes = [key for key in steps_of if not key[2]]

        def verify(keys, completions):
            rows = [row_of(key) for key in keys]
            return verifier([r["prompt"] for r in rows], completions, **reward_columns(rows))

        def assign(key, label):
            for b, j in steps_of[key]:
                labels[b][j] = label

        for key, score in zip(
            finished, verify(finished, [text for _, text, _ in finished]) if finished else [], strict=True
        ):
            assign(key, float(score or 0.0))
        if open_prefixes:
            repeated = [key for key in open_prefixes for _ in range(N)]
            _, _, cont_ids, _ = self.generate(
                [row_of(key)["prompt"] + key[1] for key in open_prefixes], samples_per_prompt=N
            )
            continuations = self.tokenizer.batch_decode(cont_ids, skip_special_tokens=True)
            scores = verify(repeated, [key[1] + c for key, c in zip(repeated, continuations, strict=True)])
            for i, key in enumerate(open_prefixes):
                assign(key, sum(float(s or 0.0) for s in scores[i * N : (i + 1) * N]) / N)
        step_ends = [list(range(n)) for n in lengths]
        return labels_to_step_rewards(labels, step_ends, device=self.device)

    def _hidden_states(self, model, *inputs):
        """Last hidden states [B, T, H] whose lm_head logits predict the completion tokens."""
        out, width = self._completion_outputs(model.get_decoder(), *inputs)
        return out.last_hidden_state[:, width - 1 : -1]

    def accumulate_gradients(self, r: Rollout, old_logps=None, ref_logps=None):
        """One backward of GRPOLoss on this rank's rollout, gradients averaged over ranks.

        The normalizers are global: dapo / cispo divide by all ranks' active tokens over the
        number of ranks (TRL's num_items_in_batch / num_processes), and bnpo's token mean is
        rescaled to all ranks' tokens, so after averaging the gradient is the one a single
        process would compute on the concatenated batch.
        """
        size = collectives.world()[1]
        local_tokens = r.completion_mask.sum().float()
        global_tokens = collectives.summed(local_tokens).clamp(min=1.0)
        options = self.loss_fn.options
        normalizer = global_tokens / size if options.takes_normalizer else None
        inputs = (r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
        # bnpo (a local token mean): a token mean over all ranks, not this rank's; declared up front as the
        # loss's scale, so that the one-pass kernel writes the gradient already scaled
        scale = local_tokens.clamp(min=1.0) * size / global_tokens if options.reduction == "batch_token_mean" else 1.0
        per_token = dict(old_logps=old_logps, ref_logps=ref_logps, normalizer=normalizer, loss_scale=scale)
        per_token["kept_set"] = self._kept_set(r)
        if options.reduction == "prompt_mean":  # this rank's groups are its prompts; the mean over all ranks' prompts
            groups = r.zero_std.numel()
            local_prompts = torch.tensor(float(groups), device=self.device)
            per_token["prompt_ids"] = torch.arange(groups, device=self.device).repeat_interleave(
                r.completion_ids.shape[0] // max(groups, 1)
            )
            per_token["loss_scale"] = local_prompts * size / collectives.summed(local_prompts).clamp(min=1.0)
        if self.entropy_control is not None:  # this step applies the coefficient the last step left
            self.loss_fn.update(entropy_coef=self.entropy_control.applied_coef())
        if self.config.fused_lm_head:

            def loss_in_forward(*batch):  # the model's forward, through its own call (grpo_kernels.wrapped)
                hidden = self._hidden_states(self.model, *batch)
                weight, bias = head_weights(self.model, self.head_transform)  # a LoRA adapter folded in
                out = self.loss_fn(
                    hidden,
                    weight.to(hidden.dtype),
                    r.completion_ids,
                    r.completion_mask,
                    r.advantages,
                    bias=None if bias is None else bias.to(hidden.dtype),
                    **per_token,
                )
                return out.loss, out

            loss, out = inside_forward(self.model, loss_in_forward, *inputs)
            out = dataclasses.replace(out, loss=loss)  # the wrapper's returned loss: its backward hooks attach to it
        else:
            logits = self._logits(self.model, *inputs)
            if self.teacher is None:
                out = self.loss_fn(logits, r.completion_ids, r.completion_mask, r.advantages, **per_token)
            else:
                out = self._distillation_output(logits, r, inputs, per_token, size, global_tokens)
        loss = out.loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self._average_gradients()
        metrics = dict(out.metrics)
        # how far the trained distribution is from the sampler's, token by token
        if r.sampler_logps is not None and out.per_token_logps is not None:
            ratio = torch.exp(out.per_token_logps.detach().float() - r.sampler_logps.float())
            active = r.completion_mask.bool()
            metrics["sampler_ratio_max_deviation"] = (ratio - 1.0).abs().masked_fill(~active, 0.0).max()
        if self.entropy_control is not None:  # one optimizer step is one window; all ranks' tokens
            self.entropy_control.observe(out.metrics["entropy"] * local_tokens.clamp(min=1.0), local_tokens)
            self.entropy_control.end_window(collectives.summed)
        return loss.detach(), metrics

    def _distillation_output(self, logits, r: Rollout, inputs, per_token: dict, size: int, global_tokens):
        """The step's loss with a teacher (``TrainerConfig.distillation``): the teacher's top-k forward KL, or the k3
        estimate of the reverse KL at the sampled tokens, on the student's logits; alone (its metrics those of the
        distillation), or times ``distillation_coef`` added to the GRPO loss of the task's rewards. A token mean over
        every rank's tokens (verl's ``global_batch_info``), as the gradients are averaged."""
        config = self.config
        with torch.no_grad():
            teacher_logits = self._logits(self.teacher, *inputs)[:, :-1].float() / config.temperature
            teacher_logps = torch.log_softmax(teacher_logits, dim=-1)
        common = dict(drop_last_position=True, dp_size=size, batch_num_tokens=global_tokens)
        if config.distillation == "topk":
            top = teacher_logps.topk(min(config.distillation_topk, teacher_logps.shape[-1]), dim=-1)
            distilled = topk_distillation_loss(
                logits, top.indices, top.values, r.completion_mask, config.temperature, compute_overlap=False,
                **common,
            )  # fmt: skip
        else:
            sampled = teacher_logps.gather(-1, r.completion_ids.unsqueeze(-1)).squeeze(-1)
            distilled = reverse_kl_distillation_loss(
                logits, r.completion_ids, sampled, r.completion_mask, config.temperature, estimator="k3", **common
            )
        if not config.distillation_with_reward:
            return GRPOLossOutput(distilled.loss, distilled.metrics, None)
        out = self.loss_fn(logits, r.completion_ids, r.completion_mask, r.advantages, **per_token)
        loss = out.loss + config.distillation_coef * distilled.loss
        return GRPOLossOutput(loss, {**out.metrics, **distilled.metrics}, out.per_token_logps)

    def _kept_set(self, r: Rollout) -> KeptSet | None:
        """The rollout's kept sets as the loss and the log-prob passes take them (with ``replay_kept_sets``)."""
        if r.kept_ids is None or not self.config.replay_kept_sets:
            return None
        return KeptSet.from_padded(r.kept_ids.to(self.device))

    def train_step(self) -> dict[str, float]:
        config, size = self.config, collectives.world()[1]
        batch = self.sample_step()
        r = batch.update
        inputs = (r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
        old_logps = ref_logps = None
        over_sets = dict(drop_last_position=True, kept_set=self._kept_set(r))  # the reference's too, as slime does
        with torch.no_grad():
            if config.num_iterations > 1:  # mu = 1 uses the on-policy shortcut (old_logps=None)
                old_logps = token_logprobs(
                    self._logits(self.model, *inputs), r.completion_ids, config.temperature, **over_sets
                )
            if self.ref_model is not None:
                ref_logps = token_logprobs(
                    self._logits(self.ref_model, *inputs), r.completion_ids, config.temperature, **over_sets
                )
        self.model.train()
        skipped = 0
        first_deviation = None  # the first inner step's: the weights that sampled
        for _ in range(config.num_iterations):
            loss, metrics = self.accumulate_gradients(r, old_logps, ref_logps)
            if first_deviation is None:
                first_deviation = metrics.get("sampler_ratio_max_deviation")
            if first_deviation is not None:
                metrics["sampler_ratio_max_deviation"] = first_deviation
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.max_grad_norm)
            # a non-finite loss or gradient norm on any rank: no rank steps (the weights stay finite)
            if collectives.largest(int(not (torch.isfinite(loss).all() and torch.isfinite(grad_norm)))):
                self.optimizer.zero_grad(set_to_none=True)
                skipped += 1
            else:
                self.optimizer.step()
        self.step += 1
        self._nonfinite_in_a_row = self._nonfinite_in_a_row + 1 if skipped else 0
        if self._nonfinite_in_a_row >= config.max_nonfinite_steps:
            raise FloatingPointError(
                f"step {self.step}: a non-finite loss or gradient norm {self._nonfinite_in_a_row} steps in a row "
                f"(max_nonfinite_steps={config.max_nonfinite_steps}); the optimizer skipped them, the weights are "
                "those of the last finite step. Look for a reward or input that makes the loss non-finite"
            )

        # reward, accuracy, zero-std share and length of everything sampled; the loss's metrics (KL,
        # entropy, clip ratios) of the update; all averaged over ranks
        s = batch.sampled
        weights = torch.tensor(self._weights(s.rewards))
        loss_metrics = {name: value.detach().float().cpu() for name, value in sorted(metrics.items())}
        loss_metrics.setdefault("kl", torch.tensor(0.0))
        if self._format_column is not None:  # the sampled answers' malformed share, beside the accuracy
            loss_metrics = {"malformed": 1.0 - s.rewards[:, self._format_column].nan_to_num(0.0).mean(), **loss_metrics}
        stats = torch.stack(
            [
                s.rewards.nan_to_num(0.0).mul(weights).sum(1).mean(),
                s.rewards[:, 0].nan_to_num(0.0).mean(),
                s.zero_std.float().mean(),
                s.completion_mask.sum().float().cpu() / s.completion_mask.shape[0],
                loss.cpu(),
                *loss_metrics.values(),
            ]
        )
        reward, accuracy, zero_std, length, loss_value, *metric_values = (collectives.summed(stats) / size).tolist()
        # what this step sampled over every rank (sample efficiency: ``training.seeds`` counts them to a target)
        sampled = collectives.summed(torch.tensor([s.completion_mask.shape[0], int(s.completion_mask.sum())])).tolist()
        record = {
            "step": self.step,
            "completions_sampled": sampled[0],
            "tokens_sampled": sampled[1],
            "reward": reward,
            "accuracy": accuracy,
            "loss": loss_value,
            "zero_std_groups": zero_std,
            "completion_length": length,
            "grad_norm": float(grad_norm),
            **dict(zip(loss_metrics, metric_values, strict=True)),
        }
        if skipped:  # the optimizer steps this step skipped for a non-finite loss or gradient norm
            record["skipped_updates"] = skipped
        if config.dynamic_sampling:  # over all ranks
            groups = collectives.summed(torch.tensor([s.zero_std.shape[0], int((~r.zero_std).sum())])).tolist()
            record.update(groups_sampled=groups[0], groups_kept=groups[1])
        if self.entropy_control is not None:
            record.update(entropy_coef=self.entropy_control.coef, entropy=self.entropy_control.last_world_entropy)
        return record

    def _weights(self, rewards: torch.Tensor) -> list[float]:
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * rewards.shape[1]

    def _average_gradients(self) -> None:
        rank, size = collectives.world()
        if size == 1:
            return
        for p in self.model.parameters():
            if p.grad is not None:
                collectives.sum_in_place(p.grad).div_(size)

    # ----- evaluation and checkpoints --------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batch_size: int = 128, progress: bool = False) -> float:
        """Greedy accuracy on the held-out rows: the mean of ``eval_reward`` (None counts as 0)."""
        if not self.eval_rows:
            return float("nan")
        correct = well_formed = 0.0
        batches = range(0, len(self.eval_rows), batch_size)
        for i in progress_bar(
            batches, desc="evaluation", unit="batch", disable=not progress, file=sys.stderr, leave=False
        ):
            rows = self.eval_rows[i : i + batch_size]
            _, _, completion_ids, _ = self.generate([r["prompt"] for r in rows], greedy=True)
            completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            prompts, columns = [r["prompt"] for r in rows], reward_columns(rows)
            correct += sum(float(s or 0.0) for s in self.eval_reward(prompts, completions, **columns))
            if self.format_reward is not None:
                well_formed += sum(float(s or 0.0) for s in self.format_reward(prompts, completions, **columns))
        self.last_eval_malformed = (
            1.0 - well_formed / len(self.eval_rows) if self.format_reward is not None else float("nan")
        )
        return correct / len(self.eval_rows)

    def _evaluation(self, progress: bool) -> dict[str, float]:
        """The held-out row of the log: the greedy accuracy, and the malformed share with ``format_reward``."""
        record = {"step": self.step, "eval_accuracy": self.evaluate(progress=progress)}
        if self.format_reward is not None:
            record["eval_malformed"] = self.last_eval_malformed
        return record

    def save_checkpoint(self, extra: dict | None = None) -> str:
        """Write checkpoint-STEP atomically (a temporary folder renamed at the end): the weights, the optimizer,
        every random generator the run draws from, the feature state (adaptive entropy) and the config. The
        reference model (beta > 0) is written once a run, beside the checkpoints (``REFERENCE_DIR``), before the
        first checkpoint that needs it."""
        final = os.path.join(self.config.output_dir, f"checkpoint-{self.step}")
        if collectives.world()[0] != 0:
            return final
        if self.ref_model is not None and not self._reference_saved:
            save_atomically(
                os.path.join(self.config.output_dir, REFERENCE_DIR),
                lambda tmp: (save_pretrained(self.ref_model, tmp), save_pretrained(self.tokenizer, tmp)),
                needed_bytes=tensor_bytes(self.ref_model.state_dict()),
            )
            self._reference_saved = True
        state = {
            "format": CHECKPOINT_FORMAT,
            "version": __version__,
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "rng": self.rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "config": dataclasses.asdict(self.config),
            "reference": REFERENCE_DIR if self.ref_model is not None else None,
            **(extra or {}),
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        if self.entropy_control is not None:
            state["entropy_control"] = self.entropy_control.state_dict()

        def write(tmp):
            save_pretrained(self.model, tmp)
            save_pretrained(self.tokenizer, tmp)
            torch.save(state, os.path.join(tmp, "trainer_state.pt"))
            write_manifest(tmp)

        save_atomically(final, write, needed_bytes=tensor_bytes(self.model.state_dict()) + tensor_bytes(state))
        return final

    def load_state(self, checkpoint: str) -> None:
        """Everything a step depends on from a checkpoint (the policy's weights are loaded with the model): the
        optimizer, the step, the random generators, the adaptive-entropy state and the reference model. A resume
        that could not continue the run exactly is refused, naming what differs (``resume_differences``). The state
        is read without running code (``read_trainer_state``)."""
        state = read_trainer_state(checkpoint)
        refused, noted = resume_differences(state, self.config, self.ref_model is not None)
        if refused:
            raise ValueError(
                f"cannot resume from {checkpoint} as the same run: "
                + "; ".join(refused)
                + ". Resume with the checkpoint's settings, or start a new run in another output dir"
            )
        for note in noted:
            warnings.warn(f"resuming from {checkpoint}: {note}", stacklevel=2)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        self.rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        if self.entropy_control is not None and "entropy_control" in state:
            self.entropy_control.load_state_dict(state["entropy_control"])
        if self.ref_model is not None:
            self._load_reference(os.path.join(self.config.output_dir, state["reference"]))

    def _load_reference(self, path: str) -> None:
        """The run's reference model (the policy it started from), not the checkpoint's policy."""
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"the run's reference model {path!r} is missing: resuming would anchor the KL "
                "to another model. Start the run again"
            )
        from transformers import AutoModelForCausalLM

        weights = AutoModelForCausalLM.from_pretrained(path).state_dict()
        self.ref_model.load_state_dict(weights)
        self._reference_saved = True

    def train(self, on_step: Callable[[dict], None] | None = None, progress: bool = False) -> list[dict]:
        """Run to ``config.steps``: evaluate first and at the end, save every ``save_every``.

        ``progress`` shows a bar for each evaluation (the caller shows the steps'), on rank 0.
        """
        records = []
        emit = lambda r: (records.append(r), self.log(r))  # noqa: E731
        show = progress and collectives.world()[0] == 0
        if self.step == 0 and self.eval_rows:
            emit(self._evaluation(show))
        with stop_requests() as received:
            while self.step < self.config.steps:
                record = self.train_step()
                emit(record)
                if on_step is not None:
                    on_step(record)
                if (
                    self.eval_rows
                    and self.config.eval_every
                    and self.step % self.config.eval_every == 0
                    and self.step < self.config.steps
                ):
                    emit(self._evaluation(show))
                saved = None
                if self.config.save_every and self.step % self.config.save_every == 0:
                    saved = self.save_checkpoint()
                # every rank stops at the same step: a rank that got the signal tells the others
                signum = collectives.largest(received[0] if received else 0)
                if signum and self.step < self.config.steps:  # (on the last step the run finishes as it would)
                    raise Preempted(signum, self.step, saved or self.save_checkpoint())
        if self.eval_rows and not (records and "eval_accuracy" in records[-1] and records[-1]["step"] == self.step):
            emit(self._evaluation(show))
        return records
