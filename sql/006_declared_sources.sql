-- Sources are declared objects, access is decided by the server, and BM25 statistics are kept per source.
--
-- A source's row is its whole declaration: location, globs, the groups that may read it, freshness and refresh
-- schedule. Nothing changes it implicitly; every change is a row in source_changes (who, when, before, after).
-- Visibility is read from the source at query time, so documents no longer carry a copy of the access list.
-- Lexical statistics (document frequencies, chunk counts, lengths) are kept per source and summed over the
-- sources a caller may read, so what one caller sees never depends on documents it cannot see.

ALTER TABLE sources
    ADD COLUMN source_key int GENERATED ALWAYS AS IDENTITY UNIQUE,  -- compact key for postings and statistics
    ADD COLUMN freshness_hours double precision CHECK (freshness_hours > 0),  -- NULL: KB_FRESHNESS_HOURS
    ADD COLUMN refresh_cron text,                                   -- NULL: KB_REFRESH_CRON
    ADD COLUMN allow_outside_links boolean NOT NULL DEFAULT false,  -- may a symlink lead outside the folder?
    ADD COLUMN declared_in text,                                    -- the config file that declares it; NULL: CLI
    ADD COLUMN updated_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN removed_at timestamptz,                              -- `kb source remove`: documents soft-deleted
    ADD CONSTRAINT sources_groups_not_empty CHECK (allowed_groups IS NULL OR cardinality(allowed_groups) > 0);

CREATE TABLE source_changes (
    change_id  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source_id  text NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT now(),
    actor      text NOT NULL,                    -- OS user@host and entry point, or the config file applied
    db_user    text NOT NULL DEFAULT current_user,
    action     text NOT NULL CHECK (action IN ('add', 'update', 'remove')),
    before     jsonb,
    after      jsonb
);
CREATE INDEX source_changes_by_source ON source_changes (source_id, change_id);
INSERT INTO source_changes (source_id, actor, action, after)
SELECT source_id, 'migration 006', 'add',
       jsonb_build_object('kind', kind, 'location', location, 'include', include_globs, 'exclude', exclude_globs,
                          'groups', allowed_groups)
FROM sources;

-- API keys: the server's record of who may read which groups. Only a hash of the secret is stored.
CREATE TABLE api_keys (
    key_id      text PRIMARY KEY,                -- the public half of the key, safe to show and log
    name        text NOT NULL,
    secret_hash text NOT NULL,                   -- sha256 of the secret half
    groups      text[] NOT NULL DEFAULT '{}',
    created_at  timestamptz NOT NULL DEFAULT now(),
    created_by  text NOT NULL,
    revoked_at  timestamptz
);
CREATE UNIQUE INDEX api_keys_active_name ON api_keys (name) WHERE revoked_at IS NULL;

-- Which entry point started a run (`kb ingest` or a Dagster run), and each stage's report as it finishes.
ALTER TABLE ingest_runs
    ADD COLUMN started_by text NOT NULL DEFAULT 'cli',
    ADD COLUMN external_run_id text UNIQUE,        -- the Dagster run id
    ADD COLUMN stages jsonb NOT NULL DEFAULT '{}';

-- Postings carry their chunk's source; term statistics and corpus sizes are per source.
ALTER TABLE lexical_postings ADD COLUMN source_key int;
UPDATE lexical_postings p SET source_key = s.source_key
FROM chunks c JOIN documents d USING (document_id) JOIN sources s USING (source_id)
WHERE c.chunk_id = p.chunk_id;
ALTER TABLE lexical_postings ALTER COLUMN source_key SET NOT NULL;
DROP INDEX lexical_postings_impact;
CREATE INDEX lexical_postings_impact ON lexical_postings (term, source_key, tf DESC, length) INCLUDE (chunk_id, live);

DROP TABLE lexical_terms;
CREATE TABLE lexical_terms (
    term       text NOT NULL,
    source_key int NOT NULL REFERENCES sources (source_key) ON DELETE CASCADE,
    df         bigint NOT NULL,                  -- live chunks of the source containing the term
    PRIMARY KEY (term, source_key)
);
INSERT INTO lexical_terms SELECT term, source_key, count(*) FROM lexical_postings WHERE live GROUP BY 1, 2;

DROP TABLE lexical_stats;
CREATE TABLE lexical_stats (
    source_key   int PRIMARY KEY REFERENCES sources (source_key) ON DELETE CASCADE,
    chunks       bigint NOT NULL,                -- live chunks of the source
    total_length bigint NOT NULL                 -- sum of their lexical_length
);
INSERT INTO lexical_stats
SELECT s.source_key, count(*), coalesce(sum(c.lexical_length), 0)
FROM chunks c JOIN documents d USING (document_id) JOIN sources s USING (source_id)
WHERE c.valid_to IS NULL GROUP BY s.source_key;

ALTER TABLE documents DROP COLUMN allowed_groups;
