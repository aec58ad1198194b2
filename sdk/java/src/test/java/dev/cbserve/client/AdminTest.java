package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import org.junit.jupiter.api.Test;

class AdminTest extends ServerTest {

  @Test
  void aWrongTokenIsToldApartFromAMissingOne() {
    try (CbserveAdminClient wrong =
            CbserveAdminClient.builder().target(server.adminTarget).token("wrong-token").build();
        CbserveAdminClient missing = CbserveAdminClient.builder().target(server.adminTarget).build()) {
      UnauthenticatedException e = assertThrows(UnauthenticatedException.class, wrong::status);
      assertTrue(e.details().startsWith("wrong admin token"), e.details());
      e = assertThrows(UnauthenticatedException.class, missing::status);
      assertTrue(e.details().startsWith("admin token missing"), e.details());
    }
  }

  @Test
  void wrongOrMissingTokenIsUnauthenticated() {
    for (String token : new String[] {"wrong-token", null}) {
      try (CbserveAdminClient intruder =
          CbserveAdminClient.builder().target(server.adminTarget).token(token).build()) {
        assertThrows(UnauthenticatedException.class, intruder::status);
        assertThrows(UnauthenticatedException.class, intruder::pause);
        assertThrows(UnauthenticatedException.class, () -> intruder.stop(true));
      }
    }
    assertTrue(admin.status().running()); // nothing was stopped
  }

  @Test
  void statusReportsTheEngine() {
    EngineStatus status = admin.status();
    assertTrue(status.running());
    assertFalse(status.paused());
    assertTrue(status.kvBlocksTotal() > 0);
    assertTrue(status.weightVersion() >= 1, "weight versions start at 1 (WeightsTest raises it)");
  }

  @Test
  void pauseHoldsTheEngineUntilTheLeaseIsClosed() throws Exception {
    AtomicInteger tokens = new AtomicInteger();
    CompletableFuture<Completion> done;
    try (PauseLease lease = admin.pause()) {
      assertTrue(lease.isHeld());
      assertTrue(lease.holders() >= 1);
      assertNotNull(lease.leaseExpiresAt());
      assertTrue(eventually(Duration.ofSeconds(5), () -> admin.status().paused()));
      assertEquals(1, admin.status().pauseHolders());

      done =
          CompletableFuture.supplyAsync(
              () -> {
                try (ChunkIterator chunks = client.stream(Prompt.text("paused"), greedy(8))) {
                  CompletionBuilder builder = new CompletionBuilder(chunks.requestId());
                  while (chunks.hasNext()) {
                    Chunk chunk = chunks.next();
                    tokens.addAndGet(chunk.tokenIds().size());
                    builder.add(chunk);
                  }
                  return builder.build();
                }
              });
      Thread.sleep(300);
      assertEquals(0, tokens.get(), "no token while paused");
      assertFalse(done.isDone());
    }
    Completion completion = done.get(30, TimeUnit.SECONDS);
    assertEquals(8, completion.tokenIds().size());
    assertEquals(8, tokens.get());
    assertTrue(eventually(Duration.ofSeconds(5), () -> !admin.status().paused()));
  }

  @Test
  void pauseLeaseExpires() throws Exception {
    PauseLease lease = admin.pause(PauseMode.KEEP, Duration.ofMillis(300));
    try {
      assertTrue(lease.isHeld());
      assertTrue(eventually(Duration.ofSeconds(5), () -> !lease.isHeld()));
      assertTrue(eventually(Duration.ofSeconds(5), () -> !admin.status().paused()));
    } finally {
      lease.close();
    }
  }

  @Test
  void stopRefusesRequestsUntilStart() throws Exception {
    StopResult stopped = admin.stop(false, Duration.ofSeconds(5));
    try {
      assertFalse(stopped.alreadyStopped());
      assertTrue(admin.stop(true).alreadyStopped());
      assertFalse(admin.status().running());
      assertThrows(UnavailableException.class, () -> client.generate(Prompt.text("hi"), greedy(4)));
    } finally {
      assertTrue(admin.start());
    }
    assertFalse(admin.start()); // already running
    assertEquals(4, client.generate(Prompt.text("hi"), greedy(4)).tokenIds().size());
  }
}
