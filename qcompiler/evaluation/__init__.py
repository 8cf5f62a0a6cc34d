"""Measuring a model: perplexity and embedding metrics, output-quality helpers, the markdown report."""
