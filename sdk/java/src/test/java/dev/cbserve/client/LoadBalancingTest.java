package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;
import static org.junit.jupiter.api.Assertions.fail;

import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.MethodOrderer;
import org.junit.jupiter.api.Order;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestMethodOrder;
import org.junit.jupiter.api.extension.ExtendWith;

/**
 * One client with a two-address target against two {@code cbserve serve} replicas (of the run's
 * tiny model): gRPC's round_robin spreads the calls over both, and once one replica is killed the
 * calls go on, on the other. The second test kills a replica, so the order is fixed.
 */
@ExtendWith(CbserveServerExtension.class)
@TestMethodOrder(MethodOrderer.OrderAnnotation.class)
class LoadBalancingTest {
  private static final Duration FAILOVER_BOUND = Duration.ofSeconds(15);

  private static final List<CbserveServer> replicas = new ArrayList<>();
  private static final List<CbserveAdminClient> admins = new ArrayList<>();
  private static CbserveClient client;

  @BeforeAll
  static void startReplicas(CbserveServer shared) throws Exception {
    ExecutorService starter = Executors.newFixedThreadPool(2);
    try {
      List<Future<CbserveServer>> started = new ArrayList<>();
      for (String name : List.of("replica-a", "replica-b")) {
        started.add(starter.submit(() -> CbserveServer.replica(shared.modelDir, name)));
      }
      Exception failure = null;
      for (Future<CbserveServer> future : started) {
        try {
          replicas.add(future.get());
        } catch (Exception e) {
          failure = e;
        }
      }
      if (failure != null) {
        throw failure; // stopReplicas closes the one that started
      }
    } finally {
      starter.shutdown();
    }
    for (CbserveServer replica : replicas) {
      admins.add(
          CbserveAdminClient.builder()
              .target(replica.adminTarget)
              .token(CbserveServer.ADMIN_TOKEN)
              .defaultTimeout(Duration.ofSeconds(10))
              .build());
    }
    client =
        CbserveClient.builder()
            .targets(replicas.get(0).target, replicas.get(1).target)
            .defaultTimeout(Duration.ofSeconds(10))
            .streamTimeout(Duration.ofSeconds(30))
            .build();
  }

  @AfterAll
  static void stopReplicas() {
    if (client != null) {
      client.close();
    }
    admins.forEach(CbserveAdminClient::close);
    replicas.forEach(CbserveServer::close);
  }

  private static long finished(int replica) {
    return admins.get(replica).status().finishedRequests();
  }

  private static Completion generateOnce() {
    return client.generate(Prompt.text("spread"), ServerTest.greedy(2));
  }

  @Test
  @Order(1)
  void requestsLandOnBothReplicas() throws InterruptedException {
    long[] before = {finished(0), finished(1)};
    // The first calls may all go to the replica that was ready first; within a few calls both are.
    boolean both = false;
    for (int i = 0; i < 50 && !both; i++) {
      assertEquals(2, generateOnce().tokenIds().size());
      both = finished(0) > before[0] && finished(1) > before[1];
    }
    assertTrue(
        both,
        "50 calls did not reach both replicas: finished " + (finished(0) - before[0]) + " and "
            + (finished(1) - before[1]));

    // With both ready, round_robin takes them in turn.
    long[] start = {finished(0), finished(1)};
    for (int i = 0; i < 10; i++) {
      generateOnce();
    }
    long[] spread = {finished(0) - start[0], finished(1) - start[1]};
    assertTrue(
        ServerTest.eventually(
            Duration.ofSeconds(5),
            () -> finished(0) - start[0] + finished(1) - start[1] == 10),
        "10 calls, finished " + (finished(0) - start[0]) + " + " + (finished(1) - start[1]));
    assertTrue(
        spread[0] >= 3 && spread[1] >= 3,
        "10 calls split " + spread[0] + " / " + spread[1] + ", expected about 5 / 5");
  }

  @Test
  @Order(2)
  void callsKeepSucceedingWhenOneReplicaDies() throws InterruptedException {
    long survivorBefore = finished(1);
    replicas.get(0).kill();

    // A call already picked for the dead replica may fail; within the bound, calls succeed again.
    long deadline = System.nanoTime() + FAILOVER_BOUND.toNanos();
    List<String> failures = new ArrayList<>();
    boolean recovered = false;
    while (!recovered && System.nanoTime() < deadline) {
      try {
        generateOnce();
        recovered = true;
      } catch (UnavailableException e) {
        failures.add(e.getMessage());
        Thread.sleep(100);
      }
    }
    if (!recovered) {
      fail("no call succeeded within " + FAILOVER_BOUND + " of the kill: " + failures);
    }
    // From then on every call succeeds, on the survivor; modelInfo too.
    for (int i = 0; i < 10; i++) {
      assertEquals(2, generateOnce().tokenIds().size(), "call " + i + " after recovery");
    }
    assertEquals(CbserveServer.VOCAB_SIZE, client.modelInfo().vocabSize());
    assertTrue(
        ServerTest.eventually(Duration.ofSeconds(5), () -> finished(1) - survivorBefore >= 11),
        "the survivor finished " + (finished(1) - survivorBefore) + " requests, expected >= 11");
  }
}
