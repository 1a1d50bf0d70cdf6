def paginate(items, page_size):
    """Split ``items`` into pages (lists) of ``page_size`` items; the last page may be shorter."""
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    pages = []
    for start in range(0, len(items) - page_size, page_size):
        pages.append(items[start:start + page_size])
    return pages
