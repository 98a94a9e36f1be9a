-- Run once by the postgres image on an empty data volume (docker-entrypoint-initdb.d), as POSTGRES_USER.
-- One database per server; Prefect needs the pg_trgm extension in its database.
CREATE DATABASE prefect;
CREATE DATABASE mlflow;
\connect prefect
CREATE EXTENSION IF NOT EXISTS pg_trgm;
