"""Multinomial logistic regression in numpy: the classifier's head on sentence embeddings.

Nesterov-accelerated gradient descent, at start-up rather than shipped as a second artefact that
could drift from the dataset; the result is cached by its exact inputs, since the router's training
set takes seconds (raylane.router.classifier.fitted_head). L2 regularisation keeps the
probabilities honest enough to use as a confidence.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class SoftmaxRegression:
    weights: np.ndarray  # [features, classes]
    bias: np.ndarray  # [classes]

    @classmethod
    def fit(
        cls, x: np.ndarray, y: np.ndarray, num_classes: int, l2: float = 1e-4, steps: int = 500
    ) -> "SoftmaxRegression":
        """Minimise class-balanced mean cross-entropy + l2 * |W|^2 over x [n, features], y [n] class
        indices. Balanced: each class weighs the same in all, so a route given ten examples in the
        config is not drowned by one with hundreds in the dataset."""
        x = np.hstack([x.astype(np.float64), np.ones((len(x), 1))])  # last column: the bias
        targets = np.eye(num_classes)[y]
        counts = np.bincount(y, minlength=num_classes)
        sample_weight = (len(y) / (num_classes * np.maximum(counts, 1)))[y][:, None] / len(y)
        # Step 1/L: the loss's gradient is L-Lipschitz with L <= max weight * |x|^2 / 2 + 2 * l2.
        lipschitz = sample_weight.max() * np.linalg.norm(x, 2) ** 2 / 2 + 2 * l2
        theta = prev = np.zeros((x.shape[1], num_classes))
        for step in range(1, steps + 1):
            look = theta + (step - 1) / (step + 2) * (theta - prev)
            grad = x.T @ ((_softmax(x @ look) - targets) * sample_weight)
            grad[:-1] += 2 * l2 * look[:-1]
            prev, theta = theta, look - grad / lipschitz
        return cls(theta[:-1].astype(np.float32), theta[-1].astype(np.float32))

    def logits(self, x: np.ndarray) -> np.ndarray:
        return x @ self.weights + self.bias

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        return _softmax(self.logits(x))


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)
