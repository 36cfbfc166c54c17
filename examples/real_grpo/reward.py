"""The example task's rule-based reward (verl's compute_score shape: text in, a float out).

Named on the runtime's command line, from this directory on PYTHONPATH:
``PYTHONPATH=examples/real_grpo torchrun ... -m runtime PLAN --reward-fn reward:score``.
"""


def score(prompt: str, response: str, ground_truth: str) -> float:
    """How much of the response spells the requested colour: the fraction of its letters that
    are letters of `ground_truth` (dense, so a random model already earns a little), with the
    whole word itself worth the most. 0 for an empty response."""
    del prompt  # the colour asked for is the ground_truth column
    letters = [c for c in response if not c.isspace()]
    if not letters:
        return 0.0
    spelled = sum(c in ground_truth for c in letters) / len(letters)
    words = response.split()
    exact = sum(w == ground_truth for w in words) / len(words)
    return 0.5 * spelled + 0.5 * exact
