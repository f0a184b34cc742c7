"""Retrieval: hybrid search, the query classifier, reranking, and the response shape every caller gets."""
