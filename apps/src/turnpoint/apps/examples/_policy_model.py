"""A tiny autoregressive policy: what the example policy server samples and the trainer trains.

Embedding + one GRU layer + a linear head over a vocabulary of a few dozen tokens, about
twenty thousand parameters. A GRU keeps its whole past in one hidden vector, so sampling
costs one cell step per token with no cache to manage, and a streaming server can hold a
half-finished generation as just that vector.

Everything runs on CPU with small tensors; single-threaded torch is the intended setting.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

# The weight payload carries its own format tag so a policy server refuses bytes from some
# other model instead of failing deep inside load_state_dict.
_STATE_FORMAT = "turnpoint.examples.TinyPolicy/1"


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One generated token and the log-probability it was sampled with."""

    token: int
    logprob: float


class TinyPolicy(nn.Module):
    """An embedding + GRU + linear language model over ``vocab_size`` tokens.

    ``eos_token`` ends a generation; it is returned (and scored) like any other token so
    that the policy gradient also teaches the model when to stop.

    ``weights_version`` counts updates: the trainer bumps it after each optimizer step, it
    travels with :meth:`state_bytes`, and a policy server reports it with each generation so
    that a sample can be tied to the weights that produced it.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        eos_token: int,
        embed_dim: int = 32,
        hidden_dim: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
        if not 0 <= eos_token < vocab_size:
            raise ValueError(f"eos_token {eos_token} is outside the vocabulary of {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token = eos_token
        self.weights_version = 0
        # Initialise from a private RNG stream: the same seed gives the same weights no matter
        # what the caller did with the global torch RNG, and the caller's stream is untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab_size, embed_dim)
            self.rnn = nn.GRU(embed_dim, hidden_dim, batch_first=True)
            self.head = nn.Linear(hidden_dim, vocab_size)

    # -- sampling -------------------------------------------------------------------------

    def iter_generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator,
    ) -> Iterator[SampledToken]:
        """Sample up to ``max_new_tokens`` tokens after ``prompt``, yielding each as it is drawn.

        Stops after yielding ``eos_token``. ``temperature`` 0 picks the most likely token
        (its reported logprob is then the untempered one); otherwise tokens are drawn from
        ``softmax(logits / temperature)`` with ``generator`` and the reported logprob is
        under that distribution. The same prompt, weights and generator state give the same
        tokens.

        The stream carries the model's hidden state between tokens, so weights must not be
        replaced while one is open: a policy server loads new weights between generations
        (docs/spec.md section 5.4: a generation is never cut in the middle of its token stream).
        """
        # Validated here, not in the generator body, so a bad request fails when it is made
        # rather than at the first token a streaming server pulls.
        self._check_tokens(prompt, "prompt")
        if not prompt:
            raise ValueError("prompt must not be empty")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        return self._sample(list(prompt), max_new_tokens, temperature, generator)

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator,
    ) -> tuple[list[int], list[float]]:
        """Collect :meth:`iter_generate` into ``(tokens, logprobs)``."""
        tokens: list[int] = []
        logprobs: list[float] = []
        for sampled in self.iter_generate(prompt, max_new_tokens, temperature, generator):
            tokens.append(sampled.token)
            logprobs.append(sampled.logprob)
        return tokens, logprobs

    # -- scoring --------------------------------------------------------------------------

    def sequence_logprob(
        self, prompt: Sequence[int], tokens: Sequence[int], temperature: float = 1.0
    ) -> torch.Tensor:
        """Differentiable log-probability of ``tokens`` following ``prompt`` (a 0-d tensor)."""
        return self.sequence_logprobs([(prompt, tokens)], temperature)[0]

    def sequence_logprobs(
        self,
        pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """Differentiable log-probabilities of many ``(prompt, tokens)`` pairs in one pass.

        Returns a tensor of shape ``[len(pairs)]``; an empty completion scores 0. The batch
        is right-padded: the GRU only looks backwards, so padding after a sequence cannot
        change any position that is scored.
        """
        if temperature <= 0:
            raise ValueError(f"scoring needs a temperature > 0, got {temperature}")
        if not pairs:
            return torch.zeros(0)
        rows: list[list[int]] = []
        for prompt, tokens in pairs:
            self._check_tokens(prompt, "prompt")
            self._check_tokens(tokens, "tokens")
            if not prompt:
                raise ValueError("prompt must not be empty")
            rows.append([*prompt, *tokens])
        width = max(len(row) for row in rows)
        inputs = torch.tensor([row + [0] * (width - len(row)) for row in rows])
        logits, _ = self._step(inputs, None)
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        # Position t predicts token t + 1: a completion token at index i of the row is
        # scored by the output at i - 1.
        predicted = logprobs[:, :-1, :].gather(2, inputs[:, 1:].unsqueeze(2)).squeeze(2)
        mask = torch.zeros_like(predicted)
        for row_index, (prompt, tokens) in enumerate(pairs):
            start = len(prompt) - 1
            mask[row_index, start : start + len(tokens)] = 1.0
        return (predicted * mask).sum(dim=1)

    # -- weight sync ----------------------------------------------------------------------

    def state_bytes(self) -> bytes:
        """Weights and ``weights_version`` serialised with ``torch.save`` (blocking: use a thread)."""
        buffer = io.BytesIO()
        payload = {
            "format": _STATE_FORMAT,
            "weights_version": self.weights_version,
            "state_dict": {
                name: value.detach().clone() for name, value in self.state_dict().items()
            },
        }
        torch.save(payload, buffer)
        return buffer.getvalue()

    def load_state_bytes(self, data: bytes) -> None:
        """Install weights and ``weights_version`` produced by :meth:`state_bytes` of a twin model."""
        payload = torch.load(io.BytesIO(data), weights_only=True)
        if not isinstance(payload, dict) or payload.get("format") != _STATE_FORMAT:
            raise ValueError("not a TinyPolicy weight payload")
        version = payload["weights_version"]
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"invalid weights_version {version!r} in weight payload")
        # strict=True: shapes or names that differ mean a differently configured model,
        # which must fail loudly rather than half-load.
        self.load_state_dict(payload["state_dict"], strict=True)
        self.weights_version = version

    # -- internals ------------------------------------------------------------------------

    def _sample(
        self,
        prompt: list[int],
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator,
    ) -> Iterator[SampledToken]:
        if max_new_tokens == 0:
            return
        # Grad mode is thread-local state: a no_grad block held open across a yield would
        # leak into whatever the consumer runs between tokens, so each step opens its own.
        with torch.no_grad():
            logits, hidden = self._step(torch.tensor([prompt]), None)
        for _ in range(max_new_tokens):
            with torch.no_grad():
                token, logprob = self._pick(logits, temperature, generator)
            yield SampledToken(token=token, logprob=logprob)
            if token == self.eos_token:
                return
            with torch.no_grad():
                logits, hidden = self._step(torch.tensor([[token]]), hidden)

    def _step(
        self, inputs: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        outputs, next_hidden = self.rnn(self.embed(inputs), hidden)
        logits: torch.Tensor = self.head(outputs)
        return logits, next_hidden

    def _pick(
        self, logits: torch.Tensor, temperature: float, generator: torch.Generator
    ) -> tuple[int, float]:
        last = logits[0, -1]
        if temperature == 0:
            token = int(torch.argmax(last))
            return token, float(torch.log_softmax(last, dim=-1)[token])
        logprobs = torch.log_softmax(last / temperature, dim=-1)
        token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
        return token, float(logprobs[token])

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        for token in tokens:
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"{what} token {token} is outside the vocabulary of {self.vocab_size}"
                )
