"""Answers: grounded answers over retrieved contexts, and the citation validator."""
