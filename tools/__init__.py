"""Tooling for the course (not part of labsupport): re-executing labs, drawing figures."""
