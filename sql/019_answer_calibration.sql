-- Answerability calibrated per knowledge base and per embedding model (issue 31). Whether kb answers a question is
-- a logistic model of the evidence its contexts give (pipelines/answers/evidence.py); its weights and operating
-- point are fitted on probes built from the knowledge base itself (pipelines/answers/calibration.py): questions
-- whose answer is a known chunk, and the same questions about things the knowledge base does not hold. A fit is
-- per model and per scope: the sources readable with no group ('') or with one group, so that what a caller is
-- told never depends on documents it may not read: a caller uses the largest fit that read nothing it may not read
-- today (declarations change after a fit: the fit's own record of what it read decides).
CREATE TABLE answer_calibrations (
    calibration_id bigserial PRIMARY KEY,
    model_key      text NOT NULL,
    scope_group    text NOT NULL,                 -- '' : the sources every caller reads; else one group's
    fitted_at      timestamptz NOT NULL DEFAULT now(),
    chunks         integer NOT NULL,              -- live chunks readable in the scope when fitted
    sources        text[] NOT NULL,               -- what the fit read: these sources ...
    hidden         text[] NOT NULL,               -- ... less these parts ('source_id' || E'\t' || locator prefix)
    weights        double precision[] NOT NULL,   -- bias, then evidence.FEATURES
    answer_at      double precision NOT NULL,     -- answer at or above this confidence
    report         jsonb NOT NULL                 -- probes by kind, and what the fit answers and refuses of them
);
CREATE INDEX answer_calibrations_latest ON answer_calibrations (model_key, scope_group, fitted_at DESC);

-- The probes of each fit, to show what the calibration stands on (and each source's share of them).
CREATE TABLE answer_probes (
    calibration_id bigint NOT NULL REFERENCES answer_calibrations ON DELETE CASCADE,
    probe          integer NOT NULL,
    chunk_id       bigint NOT NULL,               -- the chunk the probe was made from
    source_id      text NOT NULL,
    kind           text NOT NULL CHECK (kind IN ('answerable', 'left_out', 'near_miss')),
    question       text NOT NULL,
    features       double precision[] NOT NULL,
    confidence     double precision NOT NULL,     -- under the fit
    PRIMARY KEY (calibration_id, probe)
);
CREATE INDEX answer_probes_source ON answer_probes (source_id);
