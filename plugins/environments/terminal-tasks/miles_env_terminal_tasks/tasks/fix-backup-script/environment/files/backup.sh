#!/bin/bash
# Copy every .txt file from /app/docs into /app/backup (created if missing)
# and print how many files were copied, e.g. "copied 3 files".
SRC=/app/docs
DEST=/app/backup
mkdir -p $DEST
count=0
for f in $(ls $SRC/*.txt); do
    cp $f $DEST/
    count=$((count + 1))
done
echo "copied $cout files"
