"""Evaluation: BEIR datasets and answer sets through the real pipeline, and the HTML report."""
