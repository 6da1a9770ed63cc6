"""Exactly-once proof: sample audit logs and their coverage."""
