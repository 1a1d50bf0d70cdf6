from setuptools import setup

setup(name="greeter", version="1.0", py_modules=["greeter"])
