"""Contract suites for plugin authors: one pytest-ready suite per plugin kind.

Each module holds a base class a plugin's tests subclass, supplying a fixture that builds the
component under test; every test in the base class then runs against it.
"""
