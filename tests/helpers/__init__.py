"""Fixtures and drivers shared by the test folders."""
