-- Nothing to undo: the times keep their microseconds. Lowering the
-- precision again would round every time stored since, and bring back
-- what 0011 fixed.
SELECT 1;
