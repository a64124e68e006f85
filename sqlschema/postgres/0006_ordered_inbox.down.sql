-- The ordered inbox's state stays: acemq_inbox_held holds messages the
-- broker was told were handled, and acemq_inbox_sequences each key's last
-- applied number; dropped, the held messages would be lost and every key
-- would start again at 1 after an up. 0002's down, which drops the inbox,
-- drops them too, once no message is held.
SELECT 1;
