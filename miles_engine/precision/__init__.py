"""Low precision as one contract: the formats (:mod:`.formats`), the one quantizer every stage
uses (:mod:`.quantizer`, needs torch) and the recipe's ``precision`` section (:mod:`.config`)."""

from miles_engine.precision.formats import FORMATS, FormatName, QuantFormat, get_format

__all__ = ["FORMATS", "FormatName", "QuantFormat", "get_format"]
