"""Episodes: one task attempt from sandbox creation to reward; errors become failed samples."""
