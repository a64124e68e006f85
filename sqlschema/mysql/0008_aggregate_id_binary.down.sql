-- Nothing to undo: the column keeps comparing byte for byte, which is what
-- 0005 meant, and going back would merge keys again.
DO 0;
