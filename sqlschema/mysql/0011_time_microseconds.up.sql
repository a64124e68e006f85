-- +goose Up
-- Raises acemq_outbox's times to microseconds where another library made
-- them coarser: Rails before 7.0 made t.datetime a datetime (that is,
-- datetime(0)), and any datetime(p) or timestamp(p) with p below 6 rounds
-- what is written into it. The publisher tells the rows its call inserted
-- from those already there by their created_at, a stamp unique to the
-- microsecond: rounded, none of its rows looked like its own, a retried
-- keyed call gave back the numbers of rows it had written (the key's
-- counter then fell behind the table, and every later publish on the key
-- failed), and a call refused for a conflict left its new rows in the
-- transaction. The relay's claim ordered a second's rows by id, not as
-- they were written, and leases were rounded by up to half a second.
--
-- created_at, published_at, locked_until and processed_at: each datetime
-- or timestamp (p < 6) becomes datetime(6) or timestamp(6), the same type,
-- its nullability, comment and default kept (CURRENT_TIMESTAMP, and ON
-- UPDATE CURRENT_TIMESTAMP, become CURRENT_TIMESTAMP(6), which a (6)
-- column requires; a literal default stays as it is). The columns at 6
-- already are left out, and with none left the statement is DO 0: on a
-- table 0001 made, and on a second run, nothing happens.
--
-- On MySQL and MariaDB the change rebuilds the table (ALGORITHM=COPY):
-- every row is copied, and writes to the table wait until it is done. On
-- a large table run it at a quiet time, or make the same change with an
-- online schema tool first; this file then finds nothing to do.
--
-- processed_messages.processed_at is left as it is: the inbox tells no row
-- by it, only compares it with now (retention, the at-most-once lease),
-- where a rounded half second makes a copy wait or a purge run that much
-- early or late, and it is a table that can be large to rebuild.
--
-- With explicit_defaults_for_timestamp OFF (MariaDB's default before
-- 10.10), an ALTER TABLE gives the table's first timestamp NOT NULL
-- without a default DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP:
-- a created_at would change at every update of its row. When the table
-- has such a column and a time to raise, the session turns it ON for the
-- change, and back after (MySQL 8, whose default is ON, wants
-- SESSION_VARIABLES_ADMIN for that).
--
-- The ALTER copies each column's default back as it is, and rebuilds the
-- table: a zero date default ('0000-00-00 00:00:00', which older servers
-- took), on these columns or another, fails it under NO_ZERO_DATE and
-- NO_ZERO_IN_DATE (MySQL 8's default sql_mode, strict), every boot. They
-- are off for the change and back after, as is a group_concat_max_len of
-- MySQL 8's 1024 bytes, which cut the built statement where columns carry
-- long comments. A failed Migrate discards its connection.
SET @acemq_sql_mode = @@SESSION.sql_mode, @acemq_gcml = @@SESSION.group_concat_max_len;
SET SESSION sql_mode = TRIM(BOTH ',' FROM REPLACE(REPLACE(CONCAT(',', @@SESSION.sql_mode, ','), ',NO_ZERO_IN_DATE,', ','), ',NO_ZERO_DATE,', ','));
SET SESSION group_concat_max_len = GREATEST(@@SESSION.group_concat_max_len, 1048576);
SET @acemq_edft = @@SESSION.explicit_defaults_for_timestamp;
SET @acemq_ddl = (SELECT IF(@acemq_edft OR COUNT(*) = 0 OR SUM(DATA_TYPE = 'timestamp' AND IS_NULLABLE = 'NO' AND COLUMN_DEFAULT IS NULL) = 0
        OR SUM(COLUMN_NAME IN ('created_at', 'published_at', 'locked_until', 'processed_at') AND DATETIME_PRECISION < 6) = 0,
        'DO 0', 'SET SESSION explicit_defaults_for_timestamp = ON')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND DATA_TYPE IN ('datetime', 'timestamp'));
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;

-- information_schema tells a default differently: MySQL 8 gives a literal
-- bare and marks an expression DEFAULT_GENERATED; MariaDB quotes a literal,
-- gives an expression bare, and a nullable column's default NULL as 'NULL'.
-- Only the insert's time alone becomes CURRENT_TIMESTAMP(6); an expression
-- over it (a day later, say) is kept as it is. The texts are compared in
-- lower case: MySQL 8's information_schema may collate them binary.
SET @acemq_ddl = (SELECT IFNULL(CONCAT('ALTER TABLE acemq_outbox ', GROUP_CONCAT(
        CONCAT('MODIFY COLUMN `', COLUMN_NAME, '` ', DATA_TYPE, '(6)',
            IF(IS_NULLABLE = 'YES', ' NULL', ' NOT NULL'),
            CASE
                WHEN COLUMN_DEFAULT IS NULL OR LOWER(COLUMN_DEFAULT) = 'null' THEN ''
                WHEN LOWER(COLUMN_DEFAULT) REGEXP '^(current_timestamp|now|localtime|localtimestamp)([(][0-6]?[)])?$' THEN ' DEFAULT CURRENT_TIMESTAMP(6)'
                WHEN COLUMN_DEFAULT LIKE '''%' THEN CONCAT(' DEFAULT ', COLUMN_DEFAULT)
                WHEN LOWER(EXTRA) LIKE '%default_generated%' OR LOWER(VERSION()) LIKE '%mariadb%' THEN CONCAT(' DEFAULT (', COLUMN_DEFAULT, ')')
                ELSE CONCAT(' DEFAULT ', QUOTE(COLUMN_DEFAULT))
            END,
            IF(LOWER(EXTRA) LIKE '%on update%', ' ON UPDATE CURRENT_TIMESTAMP(6)', ''),
            IF(COLUMN_COMMENT = '', '', CONCAT(' COMMENT ', QUOTE(COLUMN_COMMENT))))
        ORDER BY ORDINAL_POSITION SEPARATOR ', ')), 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox'
      AND COLUMN_NAME IN ('created_at', 'published_at', 'locked_until', 'processed_at')
      AND DATA_TYPE IN ('datetime', 'timestamp') AND DATETIME_PRECISION < 6);
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;

SET @acemq_ddl = IF(@acemq_edft = @@SESSION.explicit_defaults_for_timestamp, 'DO 0', 'SET SESSION explicit_defaults_for_timestamp = OFF');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
SET @acemq_edft = NULL;
SET SESSION sql_mode = @acemq_sql_mode, group_concat_max_len = @acemq_gcml;
SET @acemq_sql_mode = NULL, @acemq_gcml = NULL;
