package dev.cbserve.client;

import java.time.Duration;
import java.time.Instant;

/**
 * When a request went through its stages (server wall clock); a stage not reached yet is null.
 *
 * @param queuedAt when the server accepted the request
 * @param scheduledAt when its prefill started
 * @param firstTokenAt when its first token was generated
 * @param finishedAt when it reached a terminal status
 * @param queueTime scheduledAt - queuedAt
 * @param timeToFirstToken firstTokenAt - queuedAt
 */
public record Timings(
    Instant queuedAt,
    Instant scheduledAt,
    Instant firstTokenAt,
    Instant finishedAt,
    Duration queueTime,
    Duration timeToFirstToken) {}
