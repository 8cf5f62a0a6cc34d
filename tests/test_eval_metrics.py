"""Metrics against hand-computed values on tiny cases."""

import math

import pytest
import torch

from qcompiler.evaluation.eval import embedding_fidelity, perplexity, relative_output_error


class FixedDistribution(torch.nn.Module):
    """Predicts the same next-token distribution ``p`` everywhere."""

    def __init__(self, p):
        super().__init__()
        self.logp = torch.log(torch.as_tensor(p, dtype=torch.float64))

    def forward(self, input_ids):
        return self.logp.expand(*input_ids.shape, -1).float()


def test_uniform_model_has_vocabulary_perplexity():
    tokens = torch.randint(0, 7, (500,))
    assert perplexity(FixedDistribution([1 / 7] * 7), tokens, window=16) == pytest.approx(7.0, rel=1e-5)


def test_known_distribution_perplexity_equals_exp_cross_entropy():
    p = [0.5, 0.25, 0.25]
    tokens = torch.tensor([0, 1, 2, 0] * 50)
    targets = tokens[1:].tolist()
    expected = math.exp(-sum(math.log(p[t]) for t in targets[: len(targets)]) / len(targets))
    # window 199 = all 199 targets scored exactly once, in one window
    assert perplexity(FixedDistribution(p), tokens, window=199) == pytest.approx(expected, rel=1e-6)


def test_strided_windows_score_every_target_once():
    class Counting(torch.nn.Module):
        """Perfectly predicts the next token when it has >= 3 tokens of context, else uniform over 2."""

        def forward(self, input_ids):
            nxt = (input_ids + 1) % 2
            logits = torch.full((*input_ids.shape, 2), -1e9)
            logits.scatter_(-1, nxt.unsqueeze(-1), 0.0)
            logits[:, :2] = 0.0  # first two positions of every window: uniform
            return logits

    tokens = torch.arange(41) % 2
    # disjoint windows of 8: every window's first 2 targets are uniform (ppl 2), the other 6 perfect
    assert perplexity(Counting(), tokens, window=8) == pytest.approx(2 ** (2 / 8), rel=1e-6)
    # stride 4: after the first window only the last 4 (context-rich) targets count
    assert perplexity(Counting(), tokens, window=8, stride=4) < perplexity(Counting(), tokens, window=8)


def test_cosine_and_relative_error_of_known_vectors():
    a = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    b = torch.tensor([[0.0, 1.0], [2.0, 2.0]])
    assert embedding_fidelity(a, b) == pytest.approx(0.5)  # cos = 0 and 1
    assert relative_output_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])) == pytest.approx(0.1)


def test_metric_input_errors():
    with pytest.raises(ValueError, match="need more than 16 tokens"):
        perplexity(FixedDistribution([0.5, 0.5]), torch.zeros(10, dtype=torch.long), window=16)
    with pytest.raises(ValueError, match="embedding shapes differ"):
        embedding_fidelity(torch.zeros(2, 3), torch.zeros(3, 3))
