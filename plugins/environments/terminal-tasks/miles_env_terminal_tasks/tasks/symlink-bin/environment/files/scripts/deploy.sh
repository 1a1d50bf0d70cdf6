#!/bin/bash
echo deployed "$1"
