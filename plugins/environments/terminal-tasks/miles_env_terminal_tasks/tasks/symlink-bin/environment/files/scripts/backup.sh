#!/bin/bash
echo backup done
