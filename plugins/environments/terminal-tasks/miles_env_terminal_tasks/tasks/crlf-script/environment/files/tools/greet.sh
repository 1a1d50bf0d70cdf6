#!/bin/bash
name="$1"
echo "Hello, $name!"
