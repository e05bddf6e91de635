"""Shared by the tests: scripted fakes, tiny random models and GGUFs, fault injection, a live server."""
